"""The bytes the hook counts are the bytes that cross the wire, for every codec: two ranks inside a private
network namespace, its loopback's transmit counter read around the counted steps (``test_codec_registry``
holds the hook's counts equal to the registry's wire bytes)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from het_strategy.core.codecs import Codec
from het_strategy.emulation.netshape import netns_available, shaped_namespace

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

_OK, _WHY = netns_available()

WORKER = r'''
import json, sys
from pathlib import Path
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from het_strategy.compression import Codec, CompressionState, compression_hook
from het_strategy.emulation.local_ranks import run_local_ranks
from het_strategy.emulation.netshape import loopback_tx_bytes as tx_bytes

def run(rank, world):
    out = {}
    for method in Codec:
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                        torch.nn.ReLU(), torch.nn.Linear(512, 10)))
        state = CompressionState(model, {"method": method, "warmup_steps": 0, "verbose": False})
        model.register_comm_hook(state, compression_hook)
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
        model(x).square().mean().backward()  # untimed: DDP rebuilds its buckets after the first step
        dist.barrier()
        before, sent = tx_bytes(), state.bytes_sent
        for _ in range(4):
            model.zero_grad()
            model(x).square().mean().backward()
        dist.barrier()
        out[method] = {"wire": (tx_bytes() - before) / world / 4, "hook": (state.bytes_sent - sent) / 4}
    return out

Path(sys.argv[1]).write_text(json.dumps(run_local_ranks(run, 2)[0]))
'''


@pytest.mark.skipif(not _OK, reason=f"no private network namespace here: {_WHY}")
def test_hook_counted_bytes_match_the_loopback_counter(tmp_path: Path) -> None:
    script, out = tmp_path / "wire_worker.py", tmp_path / "wire.json"
    script.write_text(WORKER)
    with shaped_namespace(None) as ns:  # only these ranks' traffic crosses this loopback
        done = ns.run([sys.executable, str(script), str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                      text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:]
    result = json.loads(out.read_text())
    assert set(result) == {str(token) for token in Codec}
    for method, figures in result.items():
        # the wire carries the counted payload plus TCP/IP headers, ACKs, gloo framing and two barriers: a tenth
        # of the payload and at most 12 kB per step and rank (PowerSGD's and top-k's payloads are small, their
        # collectives several)
        assert 0 <= figures["wire"] - figures["hook"] <= 0.1 * figures["hook"] + 12_000, (method, figures)
    assert result["none"]["wire"] / result["q4"]["wire"] > 6.5  # 4 bits on the real wire
