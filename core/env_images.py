"""The job's environment images: ``envs[].image`` directories built into content-addressed
bundles, published into the job's image cache, and what each of them registers.

    problems = image_problems(cfg, builtin_ids)     # at the edge: config validation
    async with JobImages(cfg) as images:            # at start: build, publish, unpack, pin
        images.refs[env.image]                      # "coin_env@sha256:..." for pool.session
        images.bundles[env.image]                   # its unpacked directory (the corpus child)
        EnvPool(cfg.envpool, images=images.cache)

An entry's ``image`` is a directory (made absolute against the working directory when the
config is loaded: ``core.config_sections.EnvConfig``) or a published reference
``name@sha256:<hex>``. A directory is packed with ``envpool.images.build_bundle``, so an
unchanged directory is the same image (the same digest: published and unpacked once, in
this run or any other sharing ``images.dir``); a reference is fetched through the same cache
(``images.dir``, then ``images.tiers``).

What an image registers is found in a child process (``envpool.manifest.registered_by``),
the way a container loads it: the image's modules never run in the driver, whose registry
and ``sys.modules`` stay as they were. A successful inspection is remembered by digest for
the life of the process (the config is checked at the edge and again by the job).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.config_messages import hint, listing
from core.config_sections import JOB_DISK, ImagesConfig, is_image_ref
from core.errors import ConfigError

__all__ = ["ImageInfo", "JobImages", "image_problems", "inspect_image", "open_cache"]

#: digest -> the environments it registers (a successful inspection; content-addressed)
_inspected: dict[str, dict[str, Any]] = {}


@dataclass(frozen=True)
class ImageInfo:
    source: str
    """As in the config: an absolute directory or a reference."""
    digest: str
    envs: dict[str, Any]
    """Id -> the spec (a dict) of each environment the image registers beyond the built-ins."""

    def describe(self, env_id: str) -> str:
        spec = self.envs[env_id]
        return f"entry point {spec['entry_point']}, image {self.digest[:19]}..."


class ImageSourceError(Exception):
    """An ``envs[].image`` the job cannot use; the message says what to fix."""


def open_cache(images: ImagesConfig, run_dir: Path) -> Any:
    """The job's ``TieredCache``: a disk tier under the cache directory first, then the
    configured tiers."""
    from envpool.images import DiskTier, DiskTierConfig, TieredCache, make_tier

    root = images.cache_dir(run_dir).absolute()  # containers and the corpus child chdir into bundles
    tiers = [DiskTier(DiskTierConfig(path=root / "blobs", name=JOB_DISK)), *map(make_tier, images.tiers)]
    return TieredCache(tiers, unpack_dir=root / "unpacked")


def inspect_image(source: str, images: ImagesConfig, run_dir: Path) -> ImageInfo:
    """What ``source`` (a directory or a reference) registers; ``ImageSourceError`` saying
    what to fix when it cannot be used."""
    from envpool.images import ImageError, build_bundle
    from envpool.manifest import ManifestError, read_manifest, registered_by

    if is_image_ref(source):
        from envpool.images import ImageRef

        digest = ImageRef.parse(source).digest
        if digest not in _inspected:
            try:
                root = _fetch(source, images, run_dir)
                _inspected[digest] = registered_by(root)
            except (ImageError, ManifestError, OSError) as e:
                raise ImageSourceError(f"image {source}: {e}") from None
        return ImageInfo(source, digest, _inspected[digest])
    path = Path(source)
    if not path.is_dir():
        what = "is a file, not a directory" if path.exists() else "does not exist"
        raise ImageSourceError(
            f"{source} {what}: an image is a directory holding the environment's files and an "
            "envpool.json (a relative path is taken from the working directory), or a published "
            "reference name@sha256:<64 hex>"
        )
    try:
        read_manifest(path)  # its mistakes before a bundle is packed
        digest = build_bundle(path).digest
        if digest not in _inspected:
            _inspected[digest] = registered_by(path)
    except (ImageError, ManifestError, OSError) as e:
        raise ImageSourceError(str(e)) from None
    return ImageInfo(source, digest, _inspected[digest])


def _fetch(ref: str, images: ImagesConfig, run_dir: Path) -> Path:
    """The unpacked bundle of ``ref``, through the job's cache (in a thread of its own: the
    caller may be inside an event loop, as the job is)."""

    async def get() -> Path:
        async with open_cache(images, run_dir) as cache:
            path: Path = await cache.get(ref)
            return path

    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        return ex.submit(asyncio.run, get()).result()


def image_problems(
    envs: list[Any], images: ImagesConfig, run_dir: Path, builtin: set[str], *, in_driver: set[str]
) -> list[tuple[str, str]]:
    """Every ``envs[i]`` that will not play: an image that cannot be used, an id that neither
    the built-ins (``builtin``) nor the entry's image registers (``in_driver``: the ids
    registered in this process, by a ``fabric.discover`` module, which no container or
    corpus child loads), one id that two images define differently."""
    problems: list[tuple[str, str]] = []
    infos: dict[str, ImageInfo | None] = {}
    for i, env in enumerate(envs):
        if env.image is None or env.image in infos:
            continue
        try:
            infos[env.image] = inspect_image(env.image, images, run_dir)
        except ImageSourceError as e:
            infos[env.image] = None
            problems.append((f"envs[{i}].image", str(e)))
    # which image (or the built-ins: None) defines an id, and where it was first seen
    defined: dict[str, tuple[int, ImageInfo | None]] = {}
    for i, env in enumerate(envs):
        key = f"envs[{i}].id"
        info = infos.get(env.image) if env.image is not None else None
        if env.image is not None and info is None:
            continue  # its image's problem is reported
        if info is not None and env.id in info.envs:
            by: ImageInfo | None = info
        elif env.id in builtin:
            by = None
        else:
            problems.append((key, _unknown(i, env, info, infos, envs, builtin, in_driver)))
            continue
        j, other = defined.setdefault(env.id, (i, by))
        if j != i and _digest(other) != _digest(by):
            problems.append(
                (
                    key,
                    f"{env.id!r} is defined by {_by(by, env.id)} here and by {_by(other, env.id)} in "
                    f"envs[{j}]: one id is one environment (trajectories record only the id); "
                    f"register one of them under another id, or give both entries the same image",
                )
            )
    return problems


def _digest(info: ImageInfo | None) -> str | None:
    return None if info is None else info.digest


def _by(info: ImageInfo | None, env_id: str) -> str:
    return "the built-ins" if info is None else f"image {info.source} ({info.describe(env_id)})"


def _unknown(
    i: int,
    env: Any,
    info: ImageInfo | None,
    infos: dict[str, ImageInfo | None],
    envs: list[Any],
    builtin: set[str],
    in_driver: set[str],
) -> str:
    if info is not None:
        registers = listing(info.envs) if info.envs else "nothing"
        return (
            f"{env.id!r} is neither built in nor registered by image {info.source}"
            f"{hint(env.id, list(info.envs))}; the image registers: {registers}"
        )
    for j, other in enumerate(envs):
        got = infos.get(other.image) if other.image is not None else None
        if got is not None and env.id in got.envs:
            return (
                f"{env.id!r} is registered by envs[{j}].image, not a built-in: "
                f"add `image: {other.image}` to envs[{i}]"
            )
    if env.id in in_driver:
        import envpool

        module = envpool.default_registry.spec(env.id).entry_point.partition(":")[0]
        return (
            f"{env.id!r} is registered by {module!r}, a fabric.discover module, which only the job's "
            "own process imports: its containers and the tokenizer's corpus child load the built-ins "
            f"and the entry's image. Move {module.replace('.', '/')}.py into a directory with an "
            f'envpool.json of {{"modules": ["{module}"]}} and add to envs[{i}]: '
            f"`image: {module.rpartition('.')[2]}_image` (that directory, relative to the working "
            "directory); see 'Your own environment' in docs/job.md"
        )
    known = sorted(builtin | {e for x in infos.values() if x is not None for e in x.envs})
    return f"unknown environment {env.id!r}{hint(env.id, known)}; registered: {listing(known)}"


class JobImages:
    """The job's image cache with every ``envs[].image`` in it: directories built and
    published once (an unchanged directory is the same digest: not published again), all
    unpacked and pinned (never evicted) until the job ends."""

    def __init__(self, envs: list[Any], images: ImagesConfig, run_dir: Path):
        # each source once, under the key of its first entry (for an error)
        self.sources: dict[str, str] = {}
        for i, e in enumerate(envs):
            if e.image is not None:
                self.sources.setdefault(e.image, f"envs[{i}].image")
        self.images = images
        self.run_dir = run_dir
        self.cache: Any = None
        """The ``TieredCache`` for the ``EnvPool`` (None: no entry has an image)."""
        self.refs: dict[str, str] = {}
        """``envs[].image`` -> its image reference."""
        self.bundles: dict[str, Path] = {}
        """``envs[].image`` -> its unpacked bundle directory."""
        self.published = 0
        """Directories published to the cache by this job (not already there)."""
        self._pinned: list[str] = []

    async def __aenter__(self) -> JobImages:
        if not self.sources:
            return self
        self.cache = open_cache(self.images, self.run_dir)
        await self.cache.start()
        from envpool.images import ImageError

        try:
            for source, key in self.sources.items():
                try:
                    ref, self.bundles[source] = await self._acquire(source)
                except (ImageError, OSError) as e:
                    raise ConfigError([(key, f"image {source}: {e}")]) from None
                self._pinned.append(ref)
                self.refs[source] = ref
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self.cache is None:
            return
        for ref in self._pinned:
            self.cache.release(ref)
        self._pinned.clear()
        await self.cache.aclose()

    async def _acquire(self, source: str) -> tuple[str, Path]:
        """The reference of ``source`` and its unpacked bundle, pinned."""
        from envpool.images import ImageFetchError, ImageNotFound, build_bundle

        if is_image_ref(source):
            return source, await self.cache.acquire(source)
        bundle = await asyncio.to_thread(build_bundle, source)
        name = Path(source).name or "image"
        if bundle.digest in self.cache.tiers[0]:  # the job's disk tier (open_cache)
            ref = str(bundle.ref(name))  # built before, this directory unchanged: the same image
            try:
                return ref, await self.cache.acquire(ref)
            except (ImageNotFound, ImageFetchError):
                # the tier's copy went bad (the cache dropped it) or went (evicted by another
                # run sharing images.dir) since its start listed it: the bundle is in hand
                pass
        ref = await self.cache.publish(bundle, name=name)
        self.published += 1
        return ref, await self.cache.acquire(ref)
