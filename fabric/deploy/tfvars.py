"""``fabric.auto.tfvars.json``: the registered functions as input to ``terraform/``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fabric.deploy.plan import DeployedFunction, DeployError
from fabric.deploy.tfcheck import check_tfvars

TFVARS_FILE = "fabric.auto.tfvars.json"


def tfvars(
    functions: list[DeployedFunction],
    *,
    region: str,
    prefix: str,
    zip_path: str | None = None,
    image_uri: str | None = None,
    architecture: str = "x86_64",
    tags: dict[str, str] | None = None,
) -> dict[str, Any]:
    if (zip_path is None) == (image_uri is None):
        raise DeployError("the package is a zip or an image: give exactly one of zip_path, image_uri")
    package: dict[str, Any] = {"type": "zip" if zip_path else "image", "architecture": architecture}
    if zip_path:
        package["zip_path"] = zip_path
    else:
        package["image_uri"] = image_uri
    values: dict[str, Any] = {
        "region": region,
        "name_prefix": prefix,
        "package": package,
        "functions": {
            f.name: {
                "modules": f.module,
                "memory_mb": f.memory_mb,
                "timeout_s": f.timeout_s,
                "warm": f.warm,
                "reserved_concurrency": f.reserved_concurrency,
                "description": f.description,
                "version": f.version,
                "max_attempts": f.max_attempts,
            }
            for f in functions
        },
    }
    # only when given: a value here replaces the user's own tags (terraform takes a variable
    # whole from the last file that sets it); terraform/ adds managed-by = rl-fabric itself
    if tags is not None:
        values["tags"] = tags
    return values


def dropped_functions(functions: list[DeployedFunction], terraform_dir: Path) -> list[str]:
    """The deployed names the last deploy's ``fabric.auto.tfvars.json`` in ``terraform_dir``
    lists that ``functions`` does not: ``terraform apply`` destroys them. The file is
    terraform's whole list of functions, and the package they share is rebuilt from
    ``functions`` alone, so the others cannot be kept by merging them in."""
    path = terraform_dir / TFVARS_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:  # no earlier deploy from this directory
        return []
    except OSError as e:
        raise DeployError(f"cannot read the last deploy's {path}: {e}") from e
    try:
        old = json.loads(text)
        before = {str(old["name_prefix"]) + str(name) for name in old["functions"]}
    except (ValueError, KeyError, TypeError) as e:
        # taken for "no earlier deploy", a file cut short or edited by hand turned the guard
        # off: terraform's state still holds the functions, and apply destroyed them
        raise DeployError(
            f"cannot read which functions the last deploy made from {path} "
            f"({type(e).__name__}: {e}): its list is what keeps terraform from destroying them. "
            "Restore it (from version control, or deploy again with every function the last "
            "deploy named), or pass --prune to deploy only these and let terraform remove the rest"
        ) from e
    return sorted(before - {f.deployed_name for f in functions})


def refuse_dropping(functions: list[DeployedFunction], terraform_dir: Path) -> None:
    """Raise ``DeployError`` when writing ``functions`` would have terraform destroy deployed
    ones (``dropped_functions``): a deploy of one more function with ``-f``, one without the
    ``-m`` of an earlier one, or under another ``--prefix``, destroyed what callers use."""
    gone = dropped_functions(functions, terraform_dir)
    if gone:
        raise DeployError(
            f"terraform would destroy {', '.join(gone)}: an earlier deploy made them "
            f"({terraform_dir / TFVARS_FILE}) and this one does not name them. Deploy them too "
            "(-f NAME for each, -m for their modules, the same --prefix), or pass --prune to remove them"
        )


def write_tfvars(values: dict[str, Any], terraform_dir: Path) -> Path:
    """Write the file into ``terraform_dir`` after checking every key is a declared variable
    and every object attribute a declared one (terraform would only warn, or drop it)."""
    check_declared(values, terraform_dir)
    path = terraform_dir / TFVARS_FILE
    # whole or not at all (a temp file renamed over it): a deploy stopped mid-write left a
    # file cut short, which the next deploy's dropped_functions has to refuse
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def check_declared(values: dict[str, Any], terraform_dir: Path) -> None:
    """Raise ``DeployError`` unless ``terraform_dir`` declares every key and object attribute
    of ``values`` (``write_tfvars``'s check, for a deploy to make before packaging)."""
    if not terraform_dir.is_dir():
        raise DeployError(f"no terraform directory at {str(terraform_dir)!r} (--terraform-dir)")
    problems = check_tfvars(values, terraform_dir)
    if problems:
        raise DeployError(
            f"{terraform_dir}/variables.tf does not declare what deploy writes: {'; '.join(problems)}"
        )
