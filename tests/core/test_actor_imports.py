"""What the job's actor processes import. Each is a new Python process at every job's start
(a test suite runs ~100 jobs on two cores), so a module an actor never uses costs every job
its import's CPU: the job config's models (envpool's image tiers, httpx, the pool's and the
fabric client's configs) were ~0.35 s of it in each engine replica and in the trainer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from core.policy.bundle import PolicyBundle
from core.policy.tiny_lm import TinyLM, TinyLMConfig
from core.policy.tokenizer import WordTokenizer

ROOT = Path(__file__).resolve().parents[2]
#: what an actor that loads a bundle needs none of
NOT_NEEDED = ("core.config", "core.config_sections", "core.policy.build", "envpool.images")


def _saved_bundle(tmp_path: Path) -> Path:
    tok = WordTokenizer("go wait step of say".split())
    model = TinyLM(TinyLMConfig(vocab_size=tok.vocab_size, d_model=16, n_layers=1, n_heads=2, max_len=64))
    state = model.state_dict()
    return PolicyBundle(tok.to_dict(), model.config.model_dump(), state).save(tmp_path / "policy")


def _loaded_after(code: str) -> list[str]:
    """Which of ``NOT_NEEDED`` a fresh interpreter has imported after running ``code``."""
    check = f"import sys\n{code}\nprint([m for m in {NOT_NEEDED!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return eval(out.stdout.strip().splitlines()[-1])


def test_an_engine_replica_loads_no_job_config(tmp_path):
    # the replica's engine is made from the bundle's directory (EngineReplicaActor's
    # constructor): PolicyBundle came from core.policy.build, which imports the job
    # config, the corpus and pretraining
    path = _saved_bundle(tmp_path)
    code = (
        "from core.rollout.replicas import make_engine\n"
        f"make_engine('torch', {str(path)!r}, {{}}, seed=0, model='tiny-lm')"
    )
    assert _loaded_after(code) == []


def test_the_trainer_actor_loads_no_job_config(tmp_path):
    # as Ray makes it: TrainerActor's module imported, its TrainerConfig unpickled (the job
    # pickled cfg.trainer), the bundle loaded from its directory; core.config was imported
    # for a type hint, and the unpickle imported every section of the job config
    import pickle

    from core.config import TrainerConfig

    path = _saved_bundle(tmp_path)
    (tmp_path / "cfg.pkl").write_bytes(pickle.dumps(TrainerConfig(lr=1e-3)))
    code = (
        "import pickle\n"
        "from core.trainer.actor import TrainerActor\n"
        f"cfg = pickle.loads(open({str(tmp_path / 'cfg.pkl')!r}, 'rb').read())\n"
        f"TrainerActor(cfg, {str(path)!r}, total_steps=3, temperature=1.0, seed=0)"
    )
    assert _loaded_after(code) == []


def test_the_proxy_actor_loads_no_numpy():
    # the proxy's actor imports the turn scheduler's module (its state holds one), whose
    # placements imported numpy for the reference partition alone: 0.1 s of CPU there
    code = "import core.rollout.llm_proxy, core.rollout.replicas"
    check = f"import sys\n{code}\nprint('numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, check=False)
    assert (out.returncode, out.stdout.strip()) == (0, "False"), out.stderr[-2000:]
