"""``fabric deploy``: registered functions to AWS Lambda (terraform, or boto3 directly) or Modal.

* ``plan``: what gets deployed: one ``DeployedFunction`` per registered function.
* ``package``: the Lambda zip (code, and dependencies built for Lambda's platform) or a
  container image build context for heavy functions.
* ``tfvars``: ``fabric.auto.tfvars.json`` for ``terraform/``; ``terraform``: init/plan/apply.
* ``direct``: create or update, publish, alias ``live``, concurrency, through boto3.
* ``modal_``: a ``modal.App`` with one function per registered function.
"""

from fabric.deploy.plan import DeployedFunction, DeployError, plan_functions

__all__ = ["DeployError", "DeployedFunction", "plan_functions"]
