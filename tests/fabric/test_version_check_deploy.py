"""The version a deployed Lambda handler answers with is the caller's registry's for the
same code: the package ``fabric deploy`` builds, unpacked, its handler started in a fresh
interpreter that imports only what the package holds (as Lambda's /var/task). A version
that depended on where the files lie, or on how the modules were imported, would make every
deployed call warn (or fail under ``version_check="refuse"``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile

import pytest

pytest.importorskip("aws_lambda_powertools")

from sample_fns import REG

from fabric.deploy import plan_functions
from fabric.deploy.package import build_zip

CHECK = textwrap.dedent(
    """
    import json, sys
    import fabric
    from fabric.protocol import Invocation
    from functions import handler

    assert fabric.__file__.startswith(sys.path[0]), fabric.__file__  # the package's, not ours

    class Context:
        function_name = "rl-fabric-add"
        memory_limit_in_mb = 512
        invoked_function_arn = "arn:aws:lambda:us-east-1:123456789012:function:rl-fabric-add"
        aws_request_id = "r-1"

        def get_remaining_time_in_millis(self):
            return 30_000

    out = {}
    for name, payload in json.loads(sys.argv[1]).items():
        event = Invocation(function=name, payload=payload).model_dump(mode="json")
        reply = handler.handler(event, Context())
        out[name] = [reply["ok"], reply.get("version")]
    print(json.dumps(out))
    """
)


def test_the_deployed_handler_answers_with_the_caller_s_version(tmp_path):
    calls = {"add": {"a": 1, "b": 2}, "with_setup": {"x": 1}}  # with_setup: a setup hook's code too
    plan = plan_functions(REG, sorted(calls))
    task = tmp_path / "task"
    zipfile.ZipFile(build_zip(plan, tmp_path / "p.zip", deps=False)).extractall(task)
    (task / "version_check.py").write_text(CHECK)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RL_FABRIC_", "PYTHON"))}
    env["RL_FABRIC_MODULES"] = ",".join(sorted({f.module for f in plan}))
    env["POWERTOOLS_METRICS_NAMESPACE"] = "rl-fabric-test"
    done = subprocess.run(
        [sys.executable, "version_check.py", json.dumps(calls)],
        cwd=task,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {name: [True, REG.get(name).version] for name in calls}
