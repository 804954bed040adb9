"""``fabric serve``: the AWS Lambda Invoke API over the local warm pools (tokens, per-tenant
quotas with fair admission, Prometheus metrics). See ``_lambda_api`` for the protocol and
``app`` for how the gateway is built."""

from fabric.serve.app import INVOKE_ROUTE, Gateway
from fabric.serve.config import ServeConfig, TenantConfig, load_tenants, new_token

__all__ = ["INVOKE_ROUTE", "Gateway", "ServeConfig", "TenantConfig", "load_tenants", "new_token"]
