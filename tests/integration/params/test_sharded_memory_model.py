"""The memory model of the sharded start, where no 8-GPU machine exists: a Qwen2.5-32B shape
built on the meta device and sharded over 8 ranks (a fake process group, in a process of its
own) holds one eighth of the parameters per rank, and building it takes no real memory."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="the trainer needs torch (pip install 'staleflow[train]')")
pytest.importorskip("transformers", reason="the trainer needs transformers")

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(300)]

SCRIPT = """
import json, resource, sys, tempfile
from pathlib import Path
import torch.distributed as dist, transformers
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.fsdp import fully_shard
from staleflow.training.loading import decoder_layers, empty_causal_lm
config = transformers.Qwen2Config(vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                                  num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False)
directory = Path(tempfile.mkdtemp())
config.save_pretrained(directory)
dist.init_process_group("fake", rank=3, world_size=8, store=FakeStore())
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
model = empty_causal_lm(directory)
layers = decoder_layers(model)
largest_layer = max(sum(p.numel() * 4 for p in layer.parameters()) for layer in layers)
for layer in layers:
    fully_shard(layer)
fully_shard(model)
print(json.dumps({"full": sum(p.numel() * 4 for p in model.parameters()),
                  "shard": sum(p.to_local().numel() * 4 for p in model.parameters()),
                  "largest_layer": largest_layer, "layers": len(layers),
                  "rss_growth": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024}))
"""


def test_a_32b_shape_on_8_ranks_holds_an_eighth_per_rank_and_builds_in_no_memory() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    sizes = json.loads(done.stdout.strip().splitlines()[-1])
    assert sizes["layers"] == 64 and sizes["full"] > 130e9  # 32.8B parameters in fp32
    assert sizes["shard"] <= sizes["full"] / 8 * 1.001  # an eighth (a rank may hold one more row of a tensor)
    assert sizes["largest_layer"] < 2e9  # the one tensor being read never exceeds a layer
    assert sizes["rss_growth"] < 512 << 20  # the structure on meta: no parameter storage
