"""The step-graph path's buffer handling, run without capture on the CPU (capture needs a GPU:
tests/gpu/test_step_graphs_gpu.py): it must give the eager loop's images bit for bit, reuse one
entry per shape, drop the least recently used, and start afresh after sleep drops them."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from stagemesh.stage_service.executor.multiproc import Executor
from stagemesh.stage_service.models import DiffusionRunner, load_dit
from stagemesh.stage_service.models.dit import MIN_COND_BUCKET, cond_bucket, pad_conds, sample
from stagemesh.stage_service.models.step_graphs import StepGraphs
from stagemesh.stage_service.settings import StageSettings


@pytest.fixture(scope="module")
def dit_pair(tiny_model: Path):
    return load_dit(tiny_model)


def _conds(*lengths: int) -> list[torch.Tensor]:
    return [torch.randn(n, 64, generator=torch.Generator().manual_seed(n)) for n in lengths]


def _sample(dit_pair, conds, size=32, steps=3, guidance=4.0, graphs=None, progress=None):
    dit, decoder = dit_pair
    return sample(dit, decoder, conds, size, size, steps, guidance, list(range(len(conds))), progress, graphs)


@pytest.mark.parametrize("guidance", [4.0, 1.0])
def test_uncaptured_steps_give_the_eager_images_bit_for_bit(dit_pair, guidance):
    graphs = StepGraphs(dit_pair[0], capture=False)
    eager = _sample(dit_pair, _conds(5, 11), guidance=guidance)
    first = _sample(dit_pair, _conds(5, 11), guidance=guidance, graphs=graphs)
    again = _sample(dit_pair, _conds(5, 11), guidance=guidance, graphs=graphs)  # reused buffers
    assert torch.equal(first, eager) and torch.equal(again, eager)
    assert len(graphs) == 1


def test_progress_follows_each_step_and_may_abort(dit_pair):
    graphs = StepGraphs(dit_pair[0], capture=False)
    calls = []
    _sample(dit_pair, _conds(3), steps=4, graphs=graphs, progress=lambda k, n: calls.append((k, n)))
    assert calls == [(k, 4) for k in range(1, 5)]

    def stop_at_two(k: int, n: int) -> None:
        if k == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _sample(dit_pair, _conds(3), steps=4, graphs=graphs, progress=stop_at_two)
    # The aborted batch left the buffers half way; the next batch starts from its own noise.
    assert torch.equal(_sample(dit_pair, _conds(3), graphs=graphs), _sample(dit_pair, _conds(3)))


def test_one_entry_per_shape_least_recently_used_dropped(dit_pair):
    graphs = StepGraphs(dit_pair[0], capture=False, max_graphs=2)
    _sample(dit_pair, _conds(3), size=32, graphs=graphs)
    _sample(dit_pair, _conds(4), size=32, graphs=graphs)  # same bucket of 8: same entry
    assert len(graphs) == 1
    _sample(dit_pair, _conds(3), size=64, graphs=graphs)
    _sample(dit_pair, _conds(3), size=32, graphs=graphs)  # 32 is now the most recent
    _sample(dit_pair, _conds(3, 3), size=32, graphs=graphs)  # two rows: a third shape
    keys = [key[0] for key in graphs._steps]
    assert len(graphs) == 2 and keys == [(1, 4, 4, 4), (2, 4, 4, 4)]  # the 64² entry went


def test_sleep_drops_every_entry_and_the_next_batch_builds_anew(dit_pair):
    graphs = StepGraphs(dit_pair[0], capture=False)
    before = _sample(dit_pair, _conds(6), graphs=graphs)
    assert graphs.release_device() == 0 and len(graphs) == 0
    assert graphs.restore_device() == 0
    assert torch.equal(_sample(dit_pair, _conds(6), graphs=graphs), before) and len(graphs) == 1


def test_a_weight_moved_behind_the_graphs_back_makes_the_next_batch_capture_anew(dit_pair):
    # A sleep controller not told about the graphs (or a reload) gives the weights new storage;
    # a replay must never read the old addresses.
    dit = dit_pair[0]
    graphs = StepGraphs(dit, capture=False)
    before = _sample(dit_pair, _conds(6), graphs=graphs)
    captured = next(iter(graphs._steps.values()))
    _sample(dit_pair, _conds(6), graphs=graphs)
    assert next(iter(graphs._steps.values())) is captured  # same addresses: kept
    weight = next(dit.parameters())
    weight.data = weight.data.clone()  # same values, new storage
    assert torch.equal(_sample(dit_pair, _conds(6), graphs=graphs), before)
    assert len(graphs) == 1 and next(iter(graphs._steps.values())) is not captured


def test_conditioning_pads_to_a_power_of_two_bucket():
    assert [cond_bucket(n) for n in (1, 8, 9, 16, 17, 100)] == [MIN_COND_BUCKET, 8, 16, 16, 32, 128]
    cond, mask = pad_conds(_conds(3, 5), length=8)
    assert cond.shape == (2, 8, 64) and mask.sum(dim=1).tolist() == [3, 5]
    with pytest.raises(ValueError, match="shorter than the longest"):
        pad_conds(_conds(9), length=8)


def test_graphs_only_where_they_apply_and_the_flag_reaches_the_worker(tiny_model):
    runner = DiffusionRunner(tiny_model, "cpu")
    assert runner.graphs is None and runner.device_holders() == []  # no capture on a CPU
    parser = argparse.ArgumentParser()
    StageSettings.add_arguments(parser)
    off = StageSettings.from_args(parser.parse_args(["--kind", "diffusion", "--no-cuda-graphs"]))
    assert not off.cuda_graphs and StageSettings.from_args(parser.parse_args([])).cuda_graphs
    assert not StageSettings.from_args(parser.parse_args(off.to_flags())).cuda_graphs
    executor = Executor(StageSettings(stage_id=1, kind="diffusion", model_dir=str(tiny_model), cuda_graphs=False))
    assert [spec.settings.cuda_graphs for g in executor.groups for spec in g.specs] == [False]


def test_a_step_that_cannot_be_captured_runs_eagerly_from_then_on(dit_pair, monkeypatch):
    # No GPU here: the capture itself is replaced by one that fails as a driver would.
    from stagemesh.stage_service.models import step_graphs

    def refuse(run, device):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(step_graphs, "_capture", refuse)
    graphs = StepGraphs(dit_pair[0], capture=True)
    assert torch.equal(_sample(dit_pair, _conds(4), graphs=graphs), _sample(dit_pair, _conds(4)))
    assert not graphs._capture and len(graphs) == 1
