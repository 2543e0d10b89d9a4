"""`molctl check` with a shard that is a dangling link or a link loop: the load-strategy advice
sums what it can stat and the check goes on (vLLM loads only the shards the index names; the
model checks judge those), instead of the whole check ending in exit 1 with a bare "No such file
or directory" (issue 44's `model.load-strategy`)."""

from __future__ import annotations

import json

from molctl.errors import ExitStatus


def test_a_dangling_or_looping_shard_link_does_not_end_the_check(host):
    base = host.model / "base"
    (base / "zz-gone.safetensors").symlink_to(host.tmp / "gone")
    (base / "zz-loop.safetensors").symlink_to("zz-loop.safetensors")
    r = host.molctl("check", "tiny", "--model-root", str(host.model), "--skip", "engine", "--skip", "gpu", "--json")
    assert r.exit_code != ExitStatus.ERROR and "Traceback" not in r.stderr and "No such file" not in r.stderr, r.stderr
    checks = {c["id"]: c for c in json.loads(r.stdout)["checks"]}
    assert checks["model.load-strategy"]["status"] == "pass", checks["model.load-strategy"]
