"""TP2 x SP2 behind a real tritonserver: four CPU instances, one rank each, against the SP1 engine."""
from __future__ import annotations

import pytest
import re
import threading
from pathlib import Path

import numpy as np

from backend.engine.rollout import WorldModelEngine
from backend.model.memory import weight_parameters
from factories import tiny_request
from triton_harness import latents_of, running_server, stream

pytestmark = pytest.mark.server  # starts a real tritonserver


def test_tp2_sp2_through_triton_matches_sp1(tmp_path: Path, tiny_checkpoint: str, engine: WorldModelEngine) -> None:
    request = tiny_request()
    direct = engine.generate(request)
    expected = np.concatenate([out.latents[0].numpy() for out, _ in direct], axis=1)
    expected_frames = np.concatenate([f for _, f in direct]).astype(int)
    with running_server(tmp_path, tiny_checkpoint, sp=4, sp_degree="2", tp_degree="2", max_batch="1") as server:
        results: dict[int, list] = {}

        def one(i: int) -> None:  # two clients at once: requests reach two of the instances
            results[i] = stream(server.grpc_url, request, timeout=240)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        log = Path(server.log_path).read_text()
    assert len(results) == 2
    for blocks in results.values():
        assert [b.block_index for b in blocks] == list(range(5))
        # Row-parallel sums in another order than SP1's: float32 rounding, not bit-identical.
        assert np.abs(latents_of(blocks) - expected).max() < 1e-5
        assert np.abs(np.concatenate([b.frames for b in blocks]).astype(int) - expected_frames).max() <= 1
    weights = sorted(re.findall(r"rank (\d): transformer weights (\d+) bytes on this rank \(tp_degree=2", log))
    formula = weight_parameters(engine.ckpt.transformer, 2) * 4  # float32
    assert weights == [(str(rank), str(formula)) for rank in range(4)]
