"""Session 9's last review of the envpool changes: what it found, each pinned by a test."""

from __future__ import annotations

import tempfile
from pathlib import Path

from code_repair_helpers import edit_action, repair_fixture  # noqa: F401 - by name=

from envpool.envs.code_repair_user import remove_tree


def test_remove_tree_takes_a_dir_named_as_its_own_scratch_names():
    # remove_tree moves each dir it finds up into the top under ".envpool-rm-N": a dir the
    # module made under such a name (not empty) took the rename's target, the move failed,
    # and the work dir outlived the episode
    root = Path(tempfile.mkdtemp(prefix="review-s9-"))
    (root / ".envpool-rm-1" / "x" / "y").mkdir(parents=True)
    (root / ".envpool-rm-1" / "x" / "f").write_text("left")
    (root / ".envpool-rm-2").mkdir()
    (root / ".envpool-rm-2" / "g").write_text("left")
    (root / "a" / "b" / "c").mkdir(parents=True)
    remove_tree(root)
    assert not root.exists()


def test_a_work_dir_with_the_scratch_name_is_removed_at_close(repair):
    repair.reset(options={"task": "mathutils"})
    work = repair.env.workdir
    code = "import os\nos.makedirs('.envpool-rm-1/x/y', exist_ok=True)\n"
    assert repair.step(edit_action("mathutils.py", "def add", code + "def add")).info["valid"]
    repair.step("run_tests")
    assert (work / ".envpool-rm-1" / "x" / "y").is_dir()  # the module's code ran
    repair.close()
    assert not work.exists()
