"""Tensor parallelism inside the Ulysses group on CPU with gloo: TP2xSP1, TP2xSP2, TP4xSP1 against SP1.

Row-parallel layers sum partial products across ranks (and qk-norm sums squares across them), so the
reduction order differs from SP1's: the results agree to float32 rounding, not bit for bit.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from backend.api.request import Controls
from backend.model.checkpoint import load_transformer
from backend.model.config import read_checkpoint_configs
from backend.model.layouts import resolve_layout
from backend.model.memory import camera_modulation_bytes, self_cache_bytes, text_cache_bytes, weight_parameters
from backend.model.tensor_slices import TensorPart
from backend.parallel.grid import RankGrid
from backend.parallel.local import run_group
from factories import tiny_settings, tiny_request
from sp_workers import rollout, steered_events
from test_prompt_events import TWO_EVENTS, keys, steered

pytestmark = pytest.mark.server  # starts groups of local processes (slow)

LAYOUTS = [(2, 1), (2, 2), (4, 1)]  # (tp, sp)
HEADS = 4  # tiny preset
FLOAT32 = 4


@pytest.fixture(scope="module")
def rollouts(tiny_checkpoint: str) -> dict[tuple[int, int], list[dict]]:
    request = tiny_request()
    settings = tiny_settings(tiny_checkpoint, decode_frames=False)
    runs = {(1, 1): run_group(1, rollout, (settings, request))}
    for tp, sp in LAYOUTS:
        runs[tp, sp] = run_group(tp * sp, rollout, (dataclasses.replace(settings, tp_degree=tp, sp_degree=sp), request))
    return runs


@pytest.fixture(scope="module")
def tiny_transformer(tiny_checkpoint: str):
    return read_checkpoint_configs(resolve_layout(tiny_checkpoint)).transformer


def test_rank_layout_puts_tp_groups_on_consecutive_ranks() -> None:
    layout = RankGrid(tp=2, sp=2)
    assert layout.tp_groups() == [[0, 1], [2, 3]]
    assert layout.sp_groups() == [[0, 2], [1, 3]]
    assert RankGrid(tp=4, sp=2).tp_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [(layout.tp_rank(r), layout.sp_rank(r)) for r in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    RankGrid(tp=2, sp=4).check_hosts(2)  # 4 instances per host hold two TP groups
    with pytest.raises(Exception, match=r"tp_degree=4 must divide the instances of each server \(8 instances over "
                                        r"host_count=4\)"):
        RankGrid(tp=4, sp=2).check_hosts(4)


@pytest.mark.parametrize(("tp", "sp"), LAYOUTS)
def test_latents_match_single_rank_within_float32_rounding(rollouts, tp: int, sp: int) -> None:
    reference = rollouts[1, 1][0]
    assert reference["evicted_tokens"] > 0, "the rollout must slide the attention window"
    for rank, result in enumerate(rollouts[tp, sp]):
        diff = float(np.abs(result["latents"] - reference["latents"]).max())
        print(f"SP1 vs TP{tp}xSP{sp} rank {rank}: max abs diff {diff:.3g}")
        assert diff < 1e-5
        assert result["evicted_tokens"] == reference["evicted_tokens"]


@pytest.mark.parametrize(("tp", "sp"), LAYOUTS)
@pytest.mark.parametrize("kind", ["text_k", "text_v", "self_k", "self_v"])
def test_cache_shards_hold_heads_over_tp_times_sp(rollouts, tp: int, sp: int, kind: str) -> None:
    """Rank (tp_rank t, sp_rank s) holds heads t x H/tp + s x H/(tp sp) onwards, H/(tp sp) of them."""
    local = HEADS // (tp * sp)
    layout = RankGrid(tp, sp)
    for rank, result in enumerate(rollouts[tp, sp]):
        first = layout.tp_rank(rank) * HEADS // tp + layout.sp_rank(rank) * local
        for layer, shard in enumerate(result[kind]):
            full = rollouts[1, 1][0][kind][layer]
            assert shard.shape[2] == local
            np.testing.assert_allclose(shard, full[:, :, first : first + local], rtol=0, atol=1e-5)


@pytest.mark.parametrize(("tp", "sp"), LAYOUTS)
def test_weight_and_cache_bytes_per_rank_equal_the_formulas(rollouts, tiny_transformer, tp: int, sp: int) -> None:
    single = rollouts[1, 1][0]
    assert single["weight_bytes"] == weight_parameters(tiny_transformer) * FLOAT32
    for rank, result in enumerate(rollouts[tp, sp]):
        print(f"TP{tp}xSP{sp} rank {rank}: weights {result['weight_bytes']} B (SP1 {single['weight_bytes']} B)")
        assert result["weight_bytes"] == weight_parameters(tiny_transformer, tp) * FLOAT32 < single["weight_bytes"]
        assert result["self_cache_bytes"] == self_cache_bytes(tiny_transformer, result["window_tokens"], tp * sp, FLOAT32)
        assert result["text_cache_bytes"] == text_cache_bytes(tiny_transformer, tp * sp, FLOAT32)
        assert result["self_cache_bytes"] * tp * sp == single["self_cache_bytes"]
        # One camera modulation a block (5 blocks of 48 tokens), this rank's tokens and channels.
        assert result["camera_modulation_bytes"] == [camera_modulation_bytes(tiny_transformer, 48, sp, tp, FLOAT32)] * 5


@pytest.mark.parametrize(("tp", "sp"), LAYOUTS)
def test_exchange_bytes_per_block_are_constant_and_equal_the_formulas(rollouts, tiny_transformer, tp: int, sp: int
                                                                     ) -> None:
    """Per forward and layer: all-to-all of q, k, v, out (self) and q, out (cross) on this TP slice's heads;
    all-reduce of the three row-parallel outputs (self o, cross o, FFN) [L/sp, D] and of the three qk-norm sums
    of squares [L/sp]; all-gather of this rank's camera-modulated channels [L/sp, D/tp]. Once a block and layer
    (the camera modulation): all-reduce of the camera MLP's row-parallel output [L/sp, D]."""
    block_tokens, dim, layers, forwards = 48, tiny_transformer.dim, tiny_transformer.num_layers, 5
    tokens = block_tokens // sp
    expected = {
        "a2a_bytes": forwards * layers * 6 * tokens * (dim // tp) * FLOAT32 * (sp - 1) // sp,
        "all_reduce_bytes": (forwards * layers * (3 * tokens * dim + 3 * tokens) + layers * tokens * dim) * FLOAT32,
        "all_gather_bytes": forwards * layers * tokens * (dim // tp) * FLOAT32,
    }
    for result in rollouts[tp, sp]:
        for kind, bytes_ in expected.items():
            assert result[kind] == [bytes_] * 5, kind


@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_loads_its_slices_of_the_checkpoint(tiny_checkpoint: str, tiny_transformer, tp: int) -> None:
    """Every tensor a TP rank loads is its slice of the full one (split along one dim) or the whole tensor."""
    directory, cpu = Path(tiny_checkpoint) / "transformer", torch.device("cpu")
    full = load_transformer(directory, tiny_transformer, torch.float32, cpu).state_dict()
    split = set()
    for rank in range(tp):
        part = load_transformer(directory, tiny_transformer, torch.float32, cpu, TensorPart(rank, tp)).state_dict()
        assert part.keys() == full.keys()
        for name, tensor in part.items():
            dims = [d for d in range(tensor.dim()) if tensor.shape[d] != full[name].shape[d]]
            if not dims:
                assert torch.equal(tensor, full[name]), name
                continue
            (dim,) = dims
            split.add(name)
            size = tensor.shape[dim]
            assert size * tp == full[name].shape[dim]
            assert torch.equal(tensor, full[name].narrow(dim, rank * size, size)), name
    assert sum(math.prod(t.shape) for t in part.values()) == weight_parameters(tiny_transformer, tp)
    assert all(n.startswith("blocks.") for n in split), "only block layers are split"
    in_block = {n.split(".", 2)[-1] for n in split}
    assert in_block == {f"{attn}.{layer}.{kind}" for attn in ("self_attn", "cross_attn") for layer in "qkv"
                        for kind in ("weight", "bias")} | {
        "self_attn.o.weight", "cross_attn.o.weight", "self_attn.norm_q.weight", "self_attn.norm_k.weight",
        "cross_attn.norm_q.weight", "cross_attn.norm_k.weight", "ffn.0.weight", "ffn.0.bias", "ffn.2.weight",
        "cam_injector_layer1.weight", "cam_injector_layer1.bias", "cam_injector_layer2.weight",
        "cam_scale_layer.weight", "cam_scale_layer.bias", "cam_shift_layer.weight", "cam_shift_layer.bias"}


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_14b_weight_bytes_per_rank_from_the_manifest_equal_the_formula(tp: int) -> None:
    """bench.memory's table: the published 1,421 tensors at a TP rank's shapes against the closed form."""
    from backend.model.config import TransformerConfig
    from bench.memory import weight_bytes_from_manifest

    cfg = TransformerConfig.lingbot_14b()
    assert weight_bytes_from_manifest(cfg, tp) == weight_parameters(cfg, tp) * 2
    assert weight_parameters(cfg) == 18_544_332_864  # 18.54 B parameters, TP1


def test_bfloat16_tp2_sp2_stays_as_close_to_float32_as_sp1(rollouts, tiny_checkpoint: str) -> None:
    """In bf16 the row-parallel partial products are rounded before their float32 sum: TP2 x SP2 must add no
    more than bf16's own error (SP1 bf16 against SP1 float32) to the float32 result."""
    request = tiny_request()
    exact = rollouts[1, 1][0]["latents"]  # the same request in float32
    bf16 = tiny_settings(tiny_checkpoint, decode_frames=False, dtype="bfloat16")
    single = run_group(1, rollout, (bf16, request))[0]["latents"]
    split = run_group(4, rollout, (dataclasses.replace(bf16, tp_degree=2, sp_degree=2), request))[0]["latents"]
    own, tp_vs_sp1, tp_vs_exact = (np.abs(a - b) for a, b in ((single, exact), (split, single), (split, exact)))
    print(f"bf16: SP1 vs float32 max {own.max():.3g} mean {own.mean():.3g}; TP2xSP2 vs SP1 max "
          f"{tp_vs_sp1.max():.3g} mean {tp_vs_sp1.mean():.3g}; TP2xSP2 vs float32 mean {tp_vs_exact.mean():.3g}")
    assert tp_vs_sp1.max() < own.max() and tp_vs_sp1.mean() < own.mean()
    assert tp_vs_exact.mean() < 1.1 * own.mean()


def _bytes_read() -> int:
    """This process's bytes read by read syscalls so far (/proc/self/io rchar; page-cache hits included)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["rchar"])


def _load_and_count(directory: Path, cfg, part: TensorPart) -> int:
    before = _bytes_read()
    load_transformer(directory, cfg, torch.float32, torch.device("cpu"), part)
    return _bytes_read() - before


@pytest.mark.parametrize("tp", [2, 4])
def test_a_tp_rank_reads_only_its_slices(tiny_checkpoint: str, tiny_transformer, tp: int) -> None:
    """A TP rank reads its own weight bytes (the formula) and no more besides than a whole-model load reads
    besides the weights (headers, the index, read-ahead on small tensors): never the other ranks' slices."""
    directory = Path(tiny_checkpoint) / "transformer"
    _load_and_count(directory, tiny_transformer, TensorPart(0, 1))  # first-use imports read files too
    overhead = _load_and_count(directory, tiny_transformer, TensorPart(0, 1)) - weight_parameters(tiny_transformer) * 4
    # The other ranks' slices: what a rank reading whole tensors and slicing them would read on top.
    others = (weight_parameters(tiny_transformer) - weight_parameters(tiny_transformer, tp)) * 4
    for rank in range(tp):
        extra = _load_and_count(directory, tiny_transformer, TensorPart(rank, tp)) - weight_parameters(
            tiny_transformer, tp) * 4
        print(f"TP{tp} rank {rank}: {extra} B besides its weights (a whole load: {overhead} B)")
        assert 0 <= extra <= overhead < others


def test_tp2_x_sp2_ranks_rebuild_only_their_head_shards(tiny_checkpoint: str) -> None:
    """Two events under TP2 x SP2: the latents match SP1 to float32 rounding, each rank's text K/V after the events
    is its heads' slice of SP1's, and its size never changes."""
    settings = tiny_settings(tiny_checkpoint, decode_frames=False)
    args = (steered(Controls(keys="w")), keys(TWO_EVENTS))
    single = run_group(1, steered_events, (settings,) + args)[0]
    split = run_group(4, steered_events, (dataclasses.replace(settings, tp_degree=2, sp_degree=2),) + args)
    layout, local = RankGrid(2, 2), HEADS // 4
    for rank, result in enumerate(split):
        assert float(np.abs(result["latents"] - single["latents"]).max()) < 1e-5
        assert len(set(result["text_bytes"])) == 1 and result["text_bytes"][0] * 4 == single["text_bytes"][0]
        first = layout.tp_rank(rank) * HEADS // 2 + layout.sp_rank(rank) * local
        for kind in ("text_k", "text_v"):
            for shard, full in zip(result[kind], single[kind]):
                np.testing.assert_allclose(shard, full[:, :, first : first + local], rtol=0, atol=1e-5)
