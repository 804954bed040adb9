"""``fabric deploy``'s offline steps: the plan (names, modules, limits), the package (a
deterministic zip without dotfiles, requirements, an image context) and terraform's tfvars
(every key a declared variable)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
from sample_fns import REG

from fabric.deploy import DeployError, plan_functions
from fabric.deploy.package import build_zip, image_context, requirements
from fabric.deploy.tfcheck import check_tfvars
from fabric.deploy.tfvars import tfvars, write_tfvars

ROOT = Path(__file__).resolve().parents[2]


# -- plan


def test_plan_names_modules_and_limits():
    plan = plan_functions(REG, ["add", "sleepy"], prefix="rl-")
    assert [f.deployed_name for f in plan] == ["rl-add", "rl-sleepy"]
    assert plan[0].module == "sample_fns" and plan[0].warm == 1 and plan[0].reserved_concurrency == -1
    assert plan[1].timeout_s == 10
    assert plan_functions(REG, ["add"], warm=0)[0].warm == 0
    assert (
        plan_functions(REG, ["add"], reserved=True)[0].reserved_concurrency == REG.get("add").max_concurrency
    )


def test_plan_errors():
    with pytest.raises(DeployError, match=r"not registered: nope .*-m MODULE"):
        plan_functions(REG, ["add", "nope"])
    with pytest.raises(DeployError, match="at most 64 characters"):
        plan_functions(REG, ["add"], prefix="x" * 70)
    with pytest.raises(DeployError, match="nothing to deploy"):
        plan_functions(REG, [])


def test_a_misspelt_name_is_refused_naming_the_one_meant():
    # it listed every registered name without pointing at the one meant, unlike fabric
    # invoke, serve and bench
    with pytest.raises(DeployError, match=r"not registered: sleepi \(did you mean 'sleepy'\?\) \(known: "):
        plan_functions(REG, ["add", "sleepi"])


# -- package


@pytest.mark.parametrize("prefix", ["team.a-", "team/a-", "team a-", "équipe-"])
def test_a_prefix_no_function_name_may_hold_is_refused_before_packaging(prefix):
    """Lambda names (and terraform's name_prefix) take letters, digits, '-' and '_': a
    prefix with anything else was written to the tfvars, or sent to Lambda by --direct, after
    the packaging, and refused there in terraform's or AWS's words."""
    with pytest.raises(DeployError, match=r"--prefix .*letters, digits, '-' and '_'"):
        plan_functions(REG, ["add"], prefix=prefix)
    assert plan_functions(REG, ["add"], prefix="Team_A-")[0].deployed_name == "Team_A-add"


def test_zip_holds_the_code_and_is_deterministic(tmp_path):
    plan = plan_functions(REG, ["add"])
    a = build_zip(plan, tmp_path / "a.zip", deps=False)
    b = build_zip(plan, tmp_path / "b.zip", deps=False)
    assert a.read_bytes() == b.read_bytes()  # an unchanged package keeps its hash
    names = zipfile.ZipFile(a).namelist()
    assert "fabric/protocol.py" in names and "functions/handler.py" in names
    assert "sample_fns.py" in names  # the module the deployed function lives in
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)
    assert not (tmp_path / "a.zip.partial").exists()


def test_a_user_package_goes_without_its_dotfiles(tmp_path, monkeypatch):
    """The package's whole tree was zipped: .env (secrets), .git, a .venv inside it. Hidden
    files and directories stay out, of the zip and of an image's build context."""
    from fabric.registry import Registry

    pkg = tmp_path / "src" / "dotted_rewards"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "from fabric.registry import Registry\n"
        "REG = Registry()\n"
        "@REG.function\n"
        "def secretless(x: int) -> int:\n"
        "    return x\n"
    )
    (pkg / "sub" / "helpers.py").write_text("X = 1\n")
    (pkg / ".env").write_text("OPENAI_API_KEY=sk-secret\n")
    (pkg / "sub" / ".hidden.py").write_text("")
    for d in (".git", ".venv/lib/python3.11/site-packages/big", "sub/.cache"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "f.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    reg = Registry()
    reg.discover("dotted_rewards")
    plan = plan_functions(reg, ["secretless"])
    names = {n for n in zipfile.ZipFile(build_zip(plan, tmp_path / "f.zip", deps=False)).namelist()}
    mine = sorted(n for n in names if n.startswith("dotted_rewards/"))
    assert mine == ["dotted_rewards/__init__.py", "dotted_rewards/sub/helpers.py"], mine
    code = image_context(plan, tmp_path / "image") / "code" / "dotted_rewards"
    assert sorted(str(p.relative_to(code)) for p in code.rglob("*")) == [
        "__init__.py",
        "sub",
        "sub/helpers.py",
    ]


def test_requirements_leave_out_what_lambda_has():
    reqs = requirements()
    assert any(r.startswith("pydantic") for r in reqs) and any(
        r.startswith("aws-lambda-powertools") for r in reqs
    )
    assert not any(r.startswith(("boto3", "botocore", "torch", "ray")) for r in reqs)


def test_requirements_keep_a_base_dependency_with_an_environment_marker(monkeypatch):
    """Any requirement with a marker was taken for an extra's: a base dependency with an
    environment marker (``; python_version < "3.13"``) was left out of the package, and the
    function failed its import on Lambda. It goes in with its marker, for pip to evaluate."""
    import importlib.metadata

    declared = [
        "pydantic<3,>=2.7",
        'typing-extensions>=4.12; python_version < "3.13"',
        'sympy>=1.12; extra == "rewards"',
        'ray>=2.40; extra == "ray"',
        'tomli>=2; python_version < "3.11" and extra == "dev"',
    ]
    monkeypatch.setattr(importlib.metadata, "requires", lambda name: declared)
    assert requirements() == [
        "pydantic<3,>=2.7",
        "sympy>=1.12",
        'typing-extensions>=4.12; python_version < "3.13"',
    ]


def test_image_context(tmp_path):
    ctx = image_context(plan_functions(REG, ["add"]), tmp_path / "image")
    dockerfile = (ctx / "Dockerfile").read_text()
    assert "FROM public.ecr.aws/lambda/python:3.11" in dockerfile
    assert 'CMD ["functions.handler.handler"]' in dockerfile
    assert (ctx / "code" / "fabric" / "protocol.py").is_file() and (ctx / "code" / "sample_fns.py").is_file()
    assert "pydantic" in (ctx / "requirements.txt").read_text()


# -- tfvars


def test_tfvars_keys_are_declared_terraform_variables(tmp_path):
    values = tfvars(plan_functions(REG, ["add", "boom"]), region="eu-west-1", prefix="rl-", zip_path="/x.zip")
    assert check_tfvars(values, ROOT / "terraform") == []
    assert values["functions"]["add"] == {
        "modules": "sample_fns",
        "memory_mb": 512,
        "timeout_s": 30,
        "warm": 1,
        "reserved_concurrency": -1,
        "description": REG.get("add").description or "rl-fabric function add",
        "version": REG.get("add").version,
        "max_attempts": REG.get("add").retry.max_attempts,
    }
    (tmp_path / "variables.tf").write_text('variable "region" {}\n')
    with pytest.raises(DeployError, match="name_prefix: not a declared variable; package: not a declared"):
        write_tfvars(values, tmp_path)
    assert check_tfvars(values, ROOT / "terraform") == []
    with pytest.raises(DeployError, match="exactly one of zip_path, image_uri"):
        tfvars([], region="r", prefix="p")


def test_a_tf_file_that_cannot_be_read_is_a_deploy_error(tmp_path):
    """A *.tf that is not UTF-8, or a directory named like one: UnicodeDecodeError or
    IsADirectoryError was `fabric deploy`'s traceback, after the packaging."""
    values = tfvars(plan_functions(REG, ["add"]), region="eu-west-1", prefix="rl-", zip_path="/x.zip")
    (tmp_path / "variables.tf").write_bytes('variable "region" {}\n'.encode("utf-16"))
    with pytest.raises(DeployError, match=r"cannot read .*variables\.tf: not UTF-8 text"):
        write_tfvars(values, tmp_path)
    (tmp_path / "variables.tf").unlink()
    (tmp_path / "old.tf").mkdir()
    with pytest.raises(DeployError, match=r"cannot read .*old\.tf: Is a directory"):
        write_tfvars(values, tmp_path)


def test_a_pip_option_that_is_no_requirement_is_said_so(tmp_path):
    """--pip 'numpy>=>1': pip's "Invalid requirement" came with advice for a dependency that
    has no wheel (--image, or --no-deps and a layer), which would not have helped."""
    from fabric.deploy.package import install_deps

    with pytest.raises(DeployError, match="Invalid requirement") as e:
        install_deps(tmp_path / "deps", pip=["numpy>=>1"])
    assert "--pip takes pip requirements" in str(e.value) and "--image" not in str(e.value)


def test_the_functions_own_dependencies_go_into_the_package(tmp_path, monkeypatch):
    """The package held rl-fabric's requirements only: a reward module of the user's that
    imports a library of its own (numpy, a verifier's parser) deployed, and then every call
    was SetupFailed, "No module named ...". --pip SPEC (repeatable) installs them too: in the
    zip, the image context's requirements.txt and the Modal image."""
    import subprocess

    from fabric.deploy import package

    assert "numpy>=1.26" in requirements(["numpy>=1.26"]) and "numpy>=1.26" not in requirements()
    ctx = image_context(plan_functions(REG, ["add"]), tmp_path / "image", pip=["numpy>=1.26"])
    assert "numpy>=1.26" in (ctx / "requirements.txt").read_text().splitlines()

    ran: list[list[str]] = []

    def fake_pip(cmd, **kw):  # no index here: the command is what matters
        ran.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(package.subprocess, "run", fake_pip)
    build_zip(plan_functions(REG, ["add"]), tmp_path / "f.zip", pip=["numpy>=1.26"])
    assert "numpy>=1.26" in ran[0] and any(r.startswith("pydantic") for r in ran[0])
