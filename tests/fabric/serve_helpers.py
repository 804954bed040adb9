"""What the ``fabric serve`` test modules (test_serve*.py) share: two tenants' tokens, the
Invoke API's path, a server's config and a request's auth header."""

from __future__ import annotations

from fabric.backends.base import LocalConfig
from fabric.serve import ServeConfig, TenantConfig

TOKEN_A = "token-a-0123456789abcdef"
TOKEN_B = "token-b-0123456789abcdef"
PATH = "/2015-03-31/functions/{}/invocations"


def config(**kw) -> ServeConfig:
    tenants = kw.pop(
        "tenants",
        {
            "job-a": TenantConfig(token=TOKEN_A, max_concurrency=kw.pop("quota_a", 64)),
            "job-b": TenantConfig(token=TOKEN_B, max_concurrency=64),
        },
    )
    kw.setdefault("warm", False)
    kw.setdefault("backend", LocalConfig(max_workers=2))
    return ServeConfig(port=0, tenants=tenants, **kw)


def auth(token: str = TOKEN_A) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}
