"""Networks: the Python API, spec files (JSON and TOML) and the built-ins."""

import json

import pytest

from legion_nn.errors import LegionNNError, ShapeError
from legion_nn.graphjson import dumps, graph_from_json, graph_to_json
from legion_nn.layers import Evaluate, Filter, FilterA, FilterNL, Linear, Softmax
from legion_nn.network import Network
from legion_nn.networks import BUILTINS, load_network
from legion_nn.spec import load_spec, network_from_dict
from legion_nn.verify import verify

TINY = {
    "name": "tiny",
    "input": [1, 20, 20],
    "classes": 10,
    "layers": [
        {
            "kind": "filter",
            "name": "L0",
            "out_channels": 8,
            "kernel": [5, 5],
            "untied": True,
            "stride": 1,
            "pad": 0,
        },
        {"kind": "filterA"},
        {"kind": "filterNL", "fn": "relu"},
        {"kind": "linear", "name": "classifier", "out": 10},
        {"kind": "softmax"},
        {"kind": "evaluate"},
    ],
}


def test_design_example_spec(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    graph = load_network(str(path)).lower(batch=5)
    verify(graph)
    names = [t.name for t in graph.tasks]
    for expected in [
        "data",
        "L0.filter",
        "L0.filterA",
        "L0.filterNL",
        "classifier.linear1",
        "classifier.softmax",
        "classifier.evaluate",
        "classifier.evaluate.accuracy",
        "L0.filter.grad",
        "update_L0.W",
        "update_W1",
    ]:
        assert expected in names
    assert graph.tensors["L0.W"].dims == (8, 1, 1, 1, 5, 5, 16, 16)
    assert graph.tensors["classifier.weights1"].dims == (10, 8, 16, 16)


def test_toml_spec(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(
        'name = "tiny"\ninput = [1, 20, 20]\nclasses = 10\n'
        '[[layers]]\nkind = "filter"\nname = "L0"\nout_channels = 8\nkernel = 5\n'
        '[[layers]]\nkind = "filterNL"\nfn = "tanh"\n'
        '[[layers]]\nkind = "linear"\nname = "classifier"\nout = 10\n'
        '[[layers]]\nkind = "softmax"\n'
    )
    graph = load_spec(path).lower(batch=2)
    verify(graph)
    assert graph.task("L0.filterNL").attrs == {"fn": "tanh"}


def test_python_api_matches_the_spec_file():
    net = Network(
        "tiny",
        (1, 20, 20),
        10,
        [
            Filter("L0", out_channels=8, kernel=5),
            FilterA(),
            FilterNL(fn="relu"),
            Linear("classifier", out=10),
            Softmax(),
            Evaluate(),
        ],
    )
    from_spec = network_from_dict(TINY, "tiny.json")
    assert dumps(net.lower(batch=3)) == dumps(from_spec.lower(batch=3))


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_spec_round_trip_of_builtins(name):
    net = load_network(name)
    again = network_from_dict(json.loads(json.dumps(net.to_spec())), f"{name}.json")
    assert dumps(net.lower(batch=2)) == dumps(again.lower(batch=2))


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_graph_json_round_trip(name):
    graph = load_network(name).lower(batch=3)
    again = graph_from_json(json.loads(dumps(graph)))
    verify(again)
    assert graph_to_json(again) == graph_to_json(graph)


def test_shape_inference():
    shapes = [(layer.stem, out) for layer, _, out in load_network("three-layer-convnet").shapes()]
    assert shapes[:3] == [
        ("conv1.conv", (32, 32, 32)),
        ("conv1.filterNL", (32, 32, 32)),
        ("pool1.maxpool", (32, 16, 16)),
    ]
    seed = [out for _, _, out in load_network("seed-lcn").shapes()]
    assert seed[0] == (64, 33, 33) and seed[3] == (64, 27, 27) and seed[6] == (3034, 1, 1)


def test_mismatch_names_the_layer_the_shapes_and_what_fits():
    with pytest.raises(ShapeError) as err:
        Network("n", (3, 6, 6), 2, [Filter("big", out_channels=2, kernel=7)])
    assert str(err.value) == (
        "layer big (filter): window 7x7 is larger than its padded input 6x6 (input shape "
        "[3, 6, 6]); a window of at most 6x6 would fit"
    )


def test_vgg19_parameters_match_the_chainer_dump():
    graph = load_network("vgg19").lower(batch=32)
    param_bytes = sum(t.nbytes for t in graph.tensors.values() if t.kind == "param")
    assert param_bytes == 574_668_960  # seed 001's /predictor/* variables
    assert graph.tensors["fc6.weights1"].dims == (4096, 512, 7, 7)
    assert graph.tensors["conv5_4.W"].dims == (512, 1, 1, 512, 3, 3, 1, 1)


def test_seed_lcn_parameter_sizes():
    graph = load_network("seed-lcn").lower(batch=256)
    assert graph.tensors["L1.W"].nbytes == 64 * 64 * 49 * 27 * 27 * 4  # ~0.6 GB of untied weights
    assert graph.tensors["classifier.weights1"].dims == (3034, 64, 27, 27)


def test_bad_batch_and_unknown_network():
    with pytest.raises(LegionNNError, match="batch must be a positive int, got 0"):
        load_network("seed-lcn-small").lower(batch=0)
    with pytest.raises(LegionNNError, match="unknown network 'nope'"):
        load_network("nope")
