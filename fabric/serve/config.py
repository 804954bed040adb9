"""``fabric serve`` settings: where to listen, who may call, how much each tenant may hold.

Every request needs a token. A tenant is a name with a token and a concurrency quota;
several training jobs share one server by each using its own tenant. Tokens come from
(first match): ``tenants`` given in code, a key file (``--tenants FILE``, YAML or JSON), a
token file (``--token-file FILE``, one token, tenant ``default``), ``--token``, or
``$RL_FABRIC_TOKEN``. With none of those the server makes a random token and prints it.

Key file::

    tenants:
      job-a: {token: "3c1f...", max_concurrency: 32}
      job-b: {token_file: /run/secrets/job-b, max_concurrency: 8}
      prometheus: {token_file: /run/secrets/prom, metrics: all, invoke: false}
"""

from __future__ import annotations

import hashlib
import secrets
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from fabric.backends.base import TOKEN_ENV, InprocConfig, LocalConfig
from fabric.config_messages import one_line, yaml_problem
from fabric.errors import ConfigError
from fabric.protocol import MAX_PAYLOAD_BYTES

__all__ = ["TOKEN_ENV", "ServeConfig", "TenantConfig", "load_tenants", "new_token"]

#: Lambda's limit on an asynchronous (``Event``) invocation's payload.
MAX_EVENT_BYTES = 1024 * 1024
#: A token shorter than this is refused: it would be guessable.
MIN_TOKEN_CHARS = 16
#: Why a tenants or token file that does not decode could not be read
NOT_UTF8 = "not UTF-8 text (save it as UTF-8)"
#: The tenant label of the requests no tenant is known for (no token, a wrong one): a tenant
#: of this name would see them as its own, and its own would be lost among them.
UNAUTHENTICATED = "-"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TenantConfig(_Model):
    """One caller of the server (a training job)."""

    token: SecretStr | None = None
    """The bearer token (stripped: spaces or a newline around it are not part of it)."""
    token_file: Path | None = None
    """Read the token from this file (stripped) instead of writing it in the key file."""
    max_concurrency: int = Field(64, ge=1)
    """Calls this tenant may have queued or running at once; beyond it a call is answered
    429 ``TooManyRequestsException`` at once (the client backs off and retries)."""
    max_rps: float | None = Field(None, gt=0)
    """Requests per second this tenant may send; faster ones are *delayed* (not refused),
    right after the token check and before the body is read. A delayed request costs the
    server nothing while it waits, so a client that ignores 429 and re-sends at once cannot
    fill the server's CPU with refusals. ``None``: no rate limit."""
    metrics: Literal["own", "all"] = "own"
    """What ``GET /metrics`` shows this tenant: ``own``, its own requests (the series
    labelled with its tenant name: counts, latency, quota) plus the pools' series, which are
    shared and count every tenant's calls together (a job sees neither another's name nor its
    requests, only the pools' totals); ``all``, every tenant's (give it to the token your
    Prometheus scrapes with)."""
    max_connections: int | None = Field(None, ge=1)
    """Connections this tenant may hold open, idle ones included; a connection counts for
    the tenant whose request came on it last. A request on a new connection past the bound
    closes the tenant's least recently used idle connection; with every one busy, it is
    answered 429 ``TooManyRequestsException`` and its connection closes. ``None``: twice
    ``max_concurrency`` (each call in flight needs a connection, and a pooling client keeps
    spares: the lambda backend's http transport up to its ``max_connections``; its boto3
    transport up to twice that per read-timeout step in use, of six, so a job whose calls'
    deadlines span several steps may hold more: the idle ones this closes it opens again)."""
    invoke: bool = True
    """Whether this tenant may invoke functions. ``false``: a token that reads ``/metrics``
    and nothing else (a monitoring scraper's, with ``metrics: all``), so a leaked scrape
    token runs no call; its invocations are answered 403 ``AccessDeniedException``, and it
    has no quota (``max_concurrency`` and ``max_rps`` are refused with it)."""

    @model_validator(mode="after")
    def _one_source(self) -> TenantConfig:
        if (self.token is None) == (self.token_file is None):
            raise ValueError("give exactly one of token, token_file")
        quota = sorted({"max_concurrency", "max_rps"} & self.model_fields_set)
        if not self.invoke and quota:
            # a quota for calls it may not make: one of the two lines is a mistake
            raise ValueError(
                f"a tenant with invoke: false makes no calls, so it has no {' or '.join(quota)}: "
                "remove it, or let the tenant invoke"
            )
        return self

    @property
    def connection_limit(self) -> int:
        """``max_connections``, or its default."""
        return self.max_connections if self.max_connections is not None else 2 * self.max_concurrency

    def secret(self) -> str:
        if self.token is not None:
            # stripped as a token_file's is, and as a request's token is read (HTTP trims a
            # header's value): a token written with a space or a newline around it (`--token`,
            # $RL_FABRIC_TOKEN filled from a file) was one no request could match
            value = self.token.get_secret_value().strip()
        else:
            assert self.token_file is not None
            try:
                value = self.token_file.read_text().strip()
            except OSError as e:
                raise ConfigError(f"cannot read token_file {str(self.token_file)!r}: {e.strerror}") from None
            except UnicodeDecodeError:  # a binary, or UTF-16 from an editor: was a traceback
                raise ConfigError(f"cannot read token_file {str(self.token_file)!r}: {NOT_UTF8}") from None
        if len(value) < MIN_TOKEN_CHARS:
            raise ConfigError(
                f"a token must have at least {MIN_TOKEN_CHARS} characters; make one with "
                "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
            )
        return value


class ServeConfig(_Model):
    """A Lambda-Invoke-compatible gateway over the local warm pools."""

    host: str = "127.0.0.1"
    """Loopback by default: binding another address is a deliberate choice (an empty one is
    refused: aiohttp binds it to every interface)."""
    port: int = Field(9000, ge=0, le=65535)
    """0 picks a free port (tests)."""
    tenants: dict[str, TenantConfig] = Field(min_length=1)
    functions: list[str] | None = None
    """Serve only these names (404 for the rest); ``None`` serves every registered function."""
    function_prefix: str = ""
    """Names in requests carry this prefix, as deployed Lambdas do (``fabric deploy
    --prefix``): the same ``LambdaConfig(function_prefix=...)`` then works here and on AWS."""
    backend: LocalConfig | InprocConfig = Field(default_factory=LocalConfig, discriminator="type")
    max_body_bytes: int = Field(MAX_PAYLOAD_BYTES, ge=1)
    """Largest ``RequestResponse`` payload (Lambda's 6 MB); bigger gets 413."""
    max_event_bytes: int = Field(MAX_EVENT_BYTES, ge=1)
    """Largest ``Event`` (asynchronous) payload (Lambda's 1 MB)."""
    body_timeout_s: float = Field(60.0, gt=0)
    """A request whose body has not all arrived this long after its headers is answered 408
    ``RequestTimeoutException``: the body's quota slot comes back. (6 MB in 60 s is 0.8
    Mbit/s.) The same bound holds for an answer: one its client has not taken this long
    after it was ready goes with its connection, and its quota slot comes back."""
    keepalive_s: float = Field(75.0, gt=0)
    """An idle connection closes after this long; so does one that has sent no request yet
    (it is no tenant's, so only time bounds it). aiohttp's own default is an hour. Longer
    than the idle timeouts of clients (aiohttp's 15 s, httpx's 5 s) and of the proxies put
    in front (nginx's upstream keepalive and an AWS ALB's: 60 s), so that they close an idle
    connection first: a request sent just as the server closes one is lost."""
    warm: bool = True
    """Start the warm workers of the served functions before accepting calls."""
    drain_s: float = Field(30.0, ge=0)
    """On shutdown the server stops accepting at once; calls in flight get this long to
    finish, then they are cancelled: one still waiting for room in its function's pool is
    answered 429 (it did not run), one running is cut (its caller sees a dropped
    connection, which the fabric client retries unless the call may have had side effects)."""

    @field_validator("tenants")
    @classmethod
    def _tenant_names(cls, tenants: dict[str, TenantConfig]) -> dict[str, TenantConfig]:
        for name in tenants:
            problem = tenant_name_problem(name)
            if problem:
                raise ValueError(f"tenant {name!r}: {problem}")
        return tenants

    @model_validator(mode="after")
    def _someone_invokes(self) -> ServeConfig:
        if not any(t.invoke for t in self.tenants.values()):
            raise ValueError(
                "no tenant may invoke a function (every one has invoke: false): give the "
                "training jobs' tenants too"
            )
        return self

    @field_validator("host")
    @classmethod
    def _host_given(cls, host: str) -> str:
        # an empty host (a script's unset $HOST) is every interface to aiohttp, IPv4 and IPv6
        if not host.strip():
            raise ValueError(
                "host is empty: give an address, 127.0.0.1 for this machine only (the default) "
                "or 0.0.0.0 for every interface"
            )
        return host.strip()

    def token_index(self) -> dict[bytes, str]:
        """sha256(token) -> tenant. Looking up a digest, not the token, keeps the lookup's
        timing independent of how much of a guessed token is right.

        A token is indexed as the bytes each kind of client sends it as: UTF-8 (aiohttp, the
        http transport; curl sends the bytes it is given) and Latin-1 where it has no other
        characters (boto3, the AWS CLI, Python's http.client): with UTF-8 only, a token with
        an ``ä`` in it was 403 over boto3."""
        index: dict[bytes, str] = {}
        for name, tenant in self.tenants.items():
            secret = tenant.secret()
            forms = {secret.encode()}
            try:
                forms.add(secret.encode("latin-1"))
            except UnicodeEncodeError:  # no client sends it as Latin-1 then
                pass
            for form in forms:
                digest = hashlib.sha256(form).digest()
                if index.get(digest, name) != name:
                    raise ConfigError(f"tenants {index[digest]!r} and {name!r} have the same token")
                index[digest] = name
        return index


def tenant_name_problem(name: str) -> str | None:
    """What is wrong with ``name`` as a tenant's name (it labels the tenant's metrics), if anything."""
    if not name.strip():
        return "the name is empty (Prometheus reads an empty label as none): give one"
    if name == UNAUTHENTICATED:
        return (
            f"the name {UNAUTHENTICATED!r} is reserved: the metrics count the requests with no "
            "valid token under it; give another"
        )
    return None


def new_token() -> str:
    return secrets.token_urlsafe(32)


def load_tenants(path: str | Path) -> dict[str, TenantConfig]:
    """Tenants from a key file (``tenants: {name: {token | token_file, max_concurrency, ...}}``)."""
    p = Path(path)
    try:
        data: Any = yaml.safe_load(p.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read the tenants file {str(p)!r}: {e.strerror}") from None
    except UnicodeDecodeError:  # a binary, or UTF-16 from an editor: was a traceback
        raise ConfigError(f"cannot read the tenants file {str(p)!r}: {NOT_UTF8}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"tenants file {str(p)!r} is not valid YAML/JSON: {yaml_problem(e)}") from None
    except RecursionError:  # the parser's, on flow collections thousands deep: was a traceback
        raise ConfigError(f"tenants file {str(p)!r} is not valid YAML/JSON: nested too deeply") from None
    if not isinstance(data, dict) or not isinstance(data.get("tenants"), dict) or not data["tenants"]:
        raise ConfigError(
            f"tenants file {str(p)!r} must hold a mapping `tenants: {{NAME: {{token: ..., "
            "max_concurrency: N}}, ...}}`"
        )
    out: dict[str, TenantConfig] = {}
    for name, body in data["tenants"].items():
        where = f"tenants file {str(p)!r}, tenant {name!r}"
        problem = tenant_name_problem(str(name))
        if problem:
            raise ConfigError(f"{where}: {problem}")
        try:
            out[str(name)] = tenant = TenantConfig.model_validate(body)
            if tenant.token_file is not None and not tenant.token_file.is_absolute():
                # beside the tenants file, as a config file's relative paths are read (a
                # compose file's, a kubeconfig's): not wherever the server was started from
                tenant.token_file = p.parent / tenant.token_file
            # a short token, an unreadable token_file: said here, where the tenant and the
            # file are known (the server's own check names neither)
            tenant.secret()
        except ValidationError as e:
            raise ConfigError(f"{where}: {one_line(e, TenantConfig)}") from None
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
    return out
