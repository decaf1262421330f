"""The op registry: every op of every network and imported graph has a complete record, a record
missing a field does not register, and the runtime's adapters and the records name each other."""

import math
from dataclasses import replace

import pytest

from legion_nn import registry
from legion_nn.importers import import_dump
from legion_nn.layers import (
    BatchNorm,
    Conv,
    Dropout,
    Evaluate,
    Filter,
    FilterA,
    FilterNL,
    Flatten,
    Linear,
    MaxPool,
    Softmax,
)
from legion_nn.network import Network
from legion_nn.networks import BUILTINS, load_network
from legion_nn.op_records import RegistryError, find_record, flops_per_element, records
from runtime.adapters import ADAPTERS, BY_OP
from runtime.adapters.registry import resolve_adapters
from tests.paths import FIXTURES

#: every layer kind in one network, so that every built-in op is lowered at least once
EVERY_LAYER = Network(
    "every-layer",
    (2, 9, 9),
    3,
    [
        Conv("c0", out_channels=3, kernel=3, pad=1, bias=False),
        BatchNorm("bn0"),
        FilterNL(fn="tanh"),
        MaxPool("p0", kernel=3, stride=2),
        Filter("L1", out_channels=4, kernel=2, untied=True),
        FilterA(),
        Dropout("d1", ratio=0.3),
        Flatten("f"),
        Linear("fc", out=3, bias=True),
        Softmax(),
        Evaluate(),
    ],
)


def _graphs():
    built = [load_network(name).lower(batch=2) for name in BUILTINS]
    built.append(EVERY_LAYER.lower(batch=2, optimizer="adam"))
    imported = [import_dump(path) for path in sorted(FIXTURES.glob("chainer_*.txt"))]
    return built, imported


BUILT, IMPORTED = _graphs()


def _phase_fields(adapter="x.forward"):
    return {"access": lambda a, d, p: {}, "flops": registry.per_element(1), "adapter": adapter}


def _fields(**phase):
    return {
        "phases": {"forward": {**_phase_fields(), **phase}},
        "splittable": registry.EVERY_DIM,
        "homing": registry.GRID,
        "packed_role": None,
        "owner_role": None,
        "passes": None,
        "sums_over": 0,
    }


@pytest.mark.parametrize("field", registry.OP_FIELDS)
def test_a_record_missing_a_field_does_not_register(field):
    fields = _fields()
    del fields[field]
    with pytest.raises(RegistryError, match=f"op 'incomplete_op': the record has no '{field}'"):
        registry.register("incomplete_op", **fields)
    assert find_record("incomplete_op") is None


@pytest.mark.parametrize("field", registry.PHASE_FIELDS)
def test_a_phase_missing_a_field_does_not_register(field):
    fields = _fields()
    del fields["phases"]["forward"][field]
    message = f"op 'incomplete_op' phase 'forward': the record has no '{field}'"
    with pytest.raises(RegistryError, match=message):
        registry.register("incomplete_op", **fields)
    assert find_record("incomplete_op") is None


def test_an_op_is_recorded_once():
    with pytest.raises(RegistryError, match="op 'conv' is recorded twice"):
        registry.register("conv", **_fields())


@pytest.mark.parametrize(
    "graph",
    BUILT + IMPORTED,
    ids=[g.network for g in BUILT] + [f"chainer-{i}" for i in range(len(IMPORTED))],
)
def test_every_lowered_op_has_a_complete_record(graph):
    for task in graph.tasks:
        record = find_record(task.op)
        assert record is not None, task.op
        assert task.phase in record.phases, (task.op, task.phase)
        flops = flops_per_element(task, graph.tensors)
        assert math.isfinite(flops) and flops >= 0, (task.name, flops)


@pytest.mark.parametrize("graph", BUILT, ids=[g.network for g in BUILT])
def test_every_built_in_op_runs_through_an_adapter(graph):
    for task in graph.tasks:
        assert (task.op, task.phase) in BY_OP, (task.op, task.phase)


def test_imported_functions_have_flops_of_their_own_or_the_stated_opaque_estimate():
    from legion_nn.importers.batch_access import OPAQUE_FLOPS

    (opaque,) = [g for g in IMPORTED if any(t.op == "chainer.Mystery" for t in g.tasks)]
    for task in opaque.tasks:
        if task.op == "chainer.Mystery":
            assert flops_per_element(task, opaque.tensors) == OPAQUE_FLOPS
    vgg = next(g for g in IMPORTED if g.network.endswith("vgg19_b32"))
    conv = next(t for t in vgg.tasks if t.op == "chainer.Convolution2DFunction")
    _, c, r, s = vgg.tensors[conv.requirement("filters").tensor].dims
    assert flops_per_element(conv, vgg.tensors) == 2 * c * r * s + 1


def test_a_record_naming_a_missing_adapter_is_an_error():
    fields = _fields()
    fields["phases"]["forward"]["adapter"] = "nowhere.forward"
    record = registry.OpRecord(
        op="ghost",
        phases={"forward": registry.PhaseRecord(**fields.pop("phases")["forward"])},
        **fields,
    )
    with pytest.raises(RegistryError, match="op 'ghost' phase 'forward': no adapter 'nowhere"):
        resolve_adapters({**records(), "ghost": record}, ADAPTERS)


def test_an_adapter_no_record_names_is_an_error():
    assert resolve_adapters(records(), ADAPTERS) == BY_OP
    with pytest.raises(RegistryError, match=r"adapters \['orphan.forward'\] are named by no"):
        resolve_adapters(records(), {**ADAPTERS, "orphan.forward": lambda *args: {}})


def test_an_op_without_a_record_has_no_flops():
    graph = BUILT[0]
    task = graph.tasks[0]
    stranger = replace(task, op="stranger")
    with pytest.raises(KeyError, match="no record for op 'stranger'"):
        flops_per_element(stranger, graph.tensors)
