"""`legion-nn partition --plot F` without --sweep: the partition map, checked on its data."""

import pytest
from matplotlib.figure import Figure

from cli.main import main
from legion_nn.networks import load_network
from legion_nn.rect import Rect
from partitioner.plan import build_plan
from partitioner.strategy import builtin
from visualize.partition_map import partition_map_figure, partition_maps
from visualize.piece_view import ranks_text

BATCH = 4


@pytest.fixture(scope="module")
def lcn():
    return load_network("seed-lcn").lower(batch=BATCH)


def maps_for(graph, strategy):
    plan = build_plan(graph, builtin(graph, strategy, 4), 4)
    return {m.unit: m for m in partition_maps(graph, plan)}


def test_one_row_per_unit_with_its_output_and_weights(lcn):
    maps = maps_for(lcn, "spatial")
    assert list(maps) == ["data", "L0", "L1", "classifier.linear1", "classifier.softmax"]
    assert [p.tensor for p in maps["L0"].output] == ["L0.filterNL.output"] * 2
    assert [p.tensor for p in maps["L1"].weights] == ["L1.W"] * 2
    assert [p.labels for p in maps["L1"].weights] == [
        ("output channels (K)", "input channels (C)"),
        ("output rows (P)", "output columns (Q)"),
    ]
    assert maps["classifier.linear1"].weights[0].tensor == "classifier.weights1"
    assert maps["classifier.softmax"].output[0].tensor == "classifier.softmax.probability"
    assert maps["data"].weights == () and maps["L1"].grid == "1×1×2×2"


def test_a_2x2_spatial_split_owns_quadrants_and_reads_7x7_halos(lcn):
    rows_by_cols = maps_for(lcn, "spatial")["L0"].output[1]
    assert rows_by_cols.labels == ("rows (H)", "columns (W)")
    assert rows_by_cols.extent == (33, 33)
    # 33 rows and columns split 17 + 16; owner computes
    assert sorted(rows_by_cols.regions, key=lambda r: r[1]) == [
        (Rect((0, 0), (17, 17)), (0,)),
        (Rect((0, 17), (17, 33)), (1,)),
        (Rect((17, 0), (33, 17)), (2,)),
        (Rect((17, 17), (33, 33)), (3,)),
    ]
    # L1's 7x7 window: output rows 0..13 read input rows 0..19, so rank 0 reads three rows and
    # columns past its quadrant, owned by ranks 1, 2 and 3
    halos = {
        rank: sorted((r for r, reader in rows_by_cols.halos if reader == rank), key=repr)
        for rank in range(4)
    }
    assert halos[0] == [Rect((0, 17), (17, 20)), Rect((17, 0), (20, 20))]
    assert halos[3] == [Rect((14, 14), (17, 33)), Rect((17, 14), (33, 17))]
    assert all(sum(r.volume for r in halos[rank]) > 0 for rank in range(4))
    assert rows_by_cols.gathered == () and not rows_by_cols.replicated
    # the batch x channels panel shows one region shared by all four, and no halo
    batch_by_channels = maps_for(lcn, "spatial")["L0"].output[0]
    assert batch_by_channels.regions == ((Rect((0, 0), (BATCH, 64)), (0, 1, 2, 3)),)
    assert batch_by_channels.halos == ()


def test_untied_weights_live_with_their_output_positions(lcn):
    channels, positions = maps_for(lcn, "spatial")["L1"].weights
    assert channels.regions == ((Rect((0, 0), (64, 64)), (0, 1, 2, 3)),)
    assert {owners: r for r, owners in positions.regions} == {
        (0,): Rect((0, 0), (14, 14)),
        (1,): Rect((0, 14), (14, 27)),
        (2,): Rect((14, 0), (27, 14)),
        (3,): Rect((14, 14), (27, 27)),
    }
    assert not positions.halos and not positions.replicated


def test_data_parallel_replicates_weights_and_splits_the_batch(lcn):
    maps = maps_for(lcn, "data")
    for panel in maps["L1"].weights:
        assert panel.replicated and [owners for _, owners in panel.regions] == [(0, 1, 2, 3)]
    batch_by_channels = maps["L1"].output[0]
    assert [(r.lo[0], r.hi[0], owners) for r, owners in batch_by_channels.regions] == [
        (0, 1, (0,)),
        (1, 2, (1,)),
        (2, 3, (2,)),
        (3, 4, (3,)),
    ]
    assert all(not p.halos for m in maps.values() for p in m.output + m.weights)


def test_a_regroup_is_marked_gathered_not_hatched(lcn):
    # the classifier splits the batch, so each rank reads every position L1 split 2x2
    rows_by_cols = maps_for(lcn, "spatial")["L1"].output[1]
    assert rows_by_cols.gathered == (0, 1, 2, 3)


def test_the_figure_draws_the_panels_and_the_halos(lcn):
    plan = build_plan(lcn, builtin(lcn, "spatial", 4), 4)
    maps = partition_maps(lcn, plan)
    fig = partition_map_figure(maps, "seed-lcn spatial")
    assert isinstance(fig, Figure)
    drawn = [ax for ax in fig.axes if ax.axison]
    assert len(drawn) == sum(len(m.output) + len(m.weights) for m in maps) == 16
    (halo_axis,) = [ax for ax in drawn if ax.get_title().startswith("L0.filterNL.output\nrows")]
    hatched = [p for p in halo_axis.patches if p.get_hatch()]
    assert len(hatched) == len(maps[1].output[1].halos) == 8
    assert {t.get_text() for t in halo_axis.texts} == {"0", "1", "2", "3"}
    (gathered,) = [ax for ax in drawn if "read whole by ranks 0–3" in ax.get_title()]
    assert not [p for p in gathered.patches if p.get_hatch()]


def test_ranks_text():
    assert ranks_text((3,)) == "3"
    assert ranks_text((0, 1)) == "0,1"
    assert ranks_text((0, 1, 2, 3)) == "0–3"
    assert ranks_text((0, 2, 5)) == "0,2,5"


def test_cli_writes_the_map_and_keeps_the_sweep_meaning(tmp_path, capsys):
    png = tmp_path / "map.png"
    args = ["partition", "seed-lcn-small", "--ranks", "4", "--strategy", "spatial"]
    assert main([*args, "--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    svg = tmp_path / "map.svg"
    assert main([*args, "--plot", str(svg)]) == 0
    assert svg.read_text().lstrip().startswith("<?xml")
    bad = tmp_path / "map.gif"
    assert main([*args, "--plot", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "--plot" in err and "unknown format" in err and len(err.strip().splitlines()) == 1
    assert not bad.exists()
    missing = tmp_path / "nowhere" / "map.png"
    assert main([*args, "--plot", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "no such directory" in err and len(err.strip().splitlines()) == 1
