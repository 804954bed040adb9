data "aws_region" "current" {}

locals {
  zip   = var.package.type == "zip"
  alias = "live"

  # a per-function image (a heavy function, e.g. an LLM judge) overrides the package
  image_uris = {
    for name, f in var.functions : name => f.image_uri != null ? f.image_uri : (local.zip ? null : var.package.image_uri)
  }

  common_env = {
    RL_FABRIC_IDEMPOTENCY_TABLE  = var.idempotency_table_name
    RL_FABRIC_IDEMPOTENCY_TTL_S  = tostring(var.idempotency_ttl_s)
    RL_FABRIC_SPILL_BUCKET       = var.spill_bucket_name
    POWERTOOLS_SERVICE_NAME      = var.service_name
    POWERTOOLS_METRICS_NAMESPACE = var.metrics_namespace
  }

  # the worker runs the shared package, so it discovers only the modules of functions
  # without their own image (those carry dependencies the package lacks)
  shared_modules = distinct(flatten([
    for f in values(var.functions) : [for m in split(",", f.modules) : trimspace(m)] if f.image_uri == null
  ]))
  all_modules = distinct(flatten([
    for f in values(var.functions) : [for m in split(",", f.modules) : trimspace(m)]
  ]))
  worker_modules = join(",", length(local.shared_modules) > 0 ? local.shared_modules : local.all_modules)

  worker_name      = "${var.name_prefix}sqs-worker"
  worker_memory_mb = coalesce(var.sqs_worker_memory_mb, max(128, [for f in values(var.functions) : f.memory_mb]...))
  # the records of a batch run one after another
  worker_timeout_s = coalesce(
    var.sqs_worker_timeout_s,
    min(900, var.sqs_batch_size * max(1, [for f in values(var.functions) : f.timeout_s]...)),
  )
  worker_storage_mb = max(512, [for f in values(var.functions) : f.ephemeral_storage_mb]...)

  # the functions with secret variables: their names are no secret (for_each and the plan
  # show them), their values stay sensitive
  secret_env_names = toset(nonsensitive(keys(var.function_environment)))

  # each function's variables that are no secret: its functions[*].environment, with the
  # user's function_settings over it (fabric deploy writes the first and never the second)
  function_env = {
    for name, f in var.functions : name => merge(f.environment, lookup(var.function_settings, name, {}))
  }

  # the worker runs the functions whose modules it discovers, each needing its variables
  # (a judge's model, its API key)
  worker_functions = sort([
    for name, f in var.functions : name if f.image_uri == null || length(local.shared_modules) == 0
  ])
  worker_env = merge({}, [for name in local.worker_functions : local.function_env[name]]...)
  worker_secret_env = merge({}, [
    for name in local.worker_functions : var.function_environment[name] if contains(local.secret_env_names, name)
  ]...)

  # One Lambda has one environment: a variable two of the worker's functions set to different
  # values would reach one of them with the other's value (a judge with another's model or
  # API key; merge() let the later name win, silently). Not isolated per function: a
  # function reads its settings at import or in its setup hook, once per process, and the
  # worker serves them all in one process. The plan fails instead, naming the variables and
  # functions (the sqs_worker's precondition). Every value is sensitive here, so that the
  # one fact taken out of them, whether they differ, is unmarked the same way whether or not a
  # secret is among them; names are no secret (as secret_env_names), values never leave.
  # each worker function's variables as its environment has them: a secret over a setting of
  # the same name (as in its own Lambda and the worker's merge), one entry per name
  worker_secret_keys = {
    for name in local.worker_functions :
    name => contains(local.secret_env_names, name) ? nonsensitive(keys(var.function_environment[name])) : []
  }
  worker_env_entries = flatten([
    for name in local.worker_functions : [
      for k in setunion(keys(local.function_env[name]), local.worker_secret_keys[name]) : {
        function = name
        variable = k
        value = (
          contains(local.worker_secret_keys[name], k)
          ? var.function_environment[name][k]
          : sensitive(local.function_env[name][k])
        )
      }
    ]
  ])
  worker_env_conflicts = [
    for k in distinct([for e in local.worker_env_entries : e.variable]) :
    "${k} (set by ${join(" and ", distinct([for e in local.worker_env_entries : e.function if e.variable == k]))})"
    if nonsensitive(length(distinct([for e in local.worker_env_entries : e.value if e.variable == k])) > 1)
  ]
}

# Created before the functions so Lambda does not create them without a retention.
resource "aws_cloudwatch_log_group" "this" {
  for_each = var.functions

  name              = "/aws/lambda/${var.name_prefix}${each.key}"
  retention_in_days = var.log_retention_days
}

resource "aws_cloudwatch_log_group" "sqs_worker" {
  count = var.sqs_worker ? 1 : 0

  name              = "/aws/lambda/${local.worker_name}"
  retention_in_days = var.log_retention_days
}

# Lambda takes a zip inline (filename) only up to 50 MB; from S3 up to 250 MB unzipped. Keyed
# by the package's hash: a new package is a new object, and the functions follow it. Lambda
# reads it with the deployer's credentials, at create or update only: the role needs none.
resource "aws_s3_object" "package" {
  count    = local.zip ? 1 : 0
  provider = aws.package

  bucket = var.spill_bucket_name
  key    = "packages/${filesha256(var.package.zip_path)}.zip"
  source = var.package.zip_path
  tags   = { "managed-by" = "rl-fabric" }
}

data "aws_iam_policy_document" "assume" {
  statement {
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = ["lambda.amazonaws.com"]
    }
  }
}

# The region in the name: IAM is global and the same prefix may be deployed in two regions.
resource "aws_iam_role" "this" {
  name               = "${var.name_prefix}functions-${data.aws_region.current.name}"
  assume_role_policy = data.aws_iam_policy_document.assume.json
}

data "aws_iam_policy_document" "this" {
  statement {
    sid     = "Logs"
    actions = ["logs:CreateLogStream", "logs:PutLogEvents"]
    # the groups' streams; no logs:CreateLogGroup, the groups are created here
    resources = [for g in values(aws_cloudwatch_log_group.this) : "${g.arn}:*"]
  }

  statement {
    sid       = "Idempotency"
    actions   = ["dynamodb:GetItem", "dynamodb:PutItem", "dynamodb:UpdateItem", "dynamodb:DeleteItem"]
    resources = [var.idempotency_table_arn]
  }

  statement {
    sid       = "SpilledPayloads"
    actions   = ["s3:GetObject"]
    resources = ["${var.spill_bucket_arn}/spill/*"]
  }
}

# The worker's own: the functions invoked directly touch no queue, and with the worker's role
# any of them (a tool running model-written code) could take the input queue's records or
# send forged results to the reply queue.
data "aws_iam_policy_document" "sqs_worker" {
  count = var.sqs_worker ? 1 : 0

  statement {
    sid       = "Logs"
    actions   = ["logs:CreateLogStream", "logs:PutLogEvents"]
    resources = ["${aws_cloudwatch_log_group.sqs_worker[0].arn}:*"]
  }

  statement {
    sid       = "Idempotency"
    actions   = ["dynamodb:GetItem", "dynamodb:PutItem", "dynamodb:UpdateItem", "dynamodb:DeleteItem"]
    resources = [var.idempotency_table_arn]
  }

  statement {
    sid       = "SpilledPayloads"
    actions   = ["s3:GetObject"]
    resources = ["${var.spill_bucket_arn}/spill/*"]
  }

  dynamic "statement" {
    for_each = var.reply_queue == null ? [] : [var.reply_queue.arn]
    content {
      sid       = "Replies"
      actions   = ["sqs:SendMessage"]
      resources = [statement.value]
    }
  }

  dynamic "statement" {
    for_each = var.input_queue == null ? [] : [var.input_queue.arn]
    content {
      sid = "Consume"
      actions = [
        "sqs:ReceiveMessage",
        "sqs:DeleteMessage",
        "sqs:GetQueueAttributes",
        "sqs:ChangeMessageVisibility",
      ]
      resources = [statement.value]
    }
  }
}

resource "aws_iam_role_policy" "this" {
  name   = "${var.name_prefix}functions"
  role   = aws_iam_role.this.id
  policy = data.aws_iam_policy_document.this.json
}

# "worker-", not "sqs-worker-": a 40-character name_prefix and a 14-character region leave 10
resource "aws_iam_role" "sqs_worker" {
  count = var.sqs_worker ? 1 : 0

  name               = "${var.name_prefix}worker-${data.aws_region.current.name}"
  assume_role_policy = data.aws_iam_policy_document.assume.json
}

resource "aws_iam_role_policy" "sqs_worker" {
  count = var.sqs_worker ? 1 : 0

  name   = "${var.name_prefix}sqs-worker"
  role   = aws_iam_role.sqs_worker[0].id
  policy = data.aws_iam_policy_document.sqs_worker[0].json
}

resource "aws_lambda_function" "this" {
  for_each = var.functions

  function_name = "${var.name_prefix}${each.key}"
  description   = each.value.description
  role          = aws_iam_role.this.arn
  architectures = [var.package.architecture]
  # every change publishes a version, and the live alias moves to it
  publish = true

  package_type     = local.image_uris[each.key] == null ? "Zip" : "Image"
  s3_bucket        = local.image_uris[each.key] == null ? aws_s3_object.package[0].bucket : null
  s3_key           = local.image_uris[each.key] == null ? aws_s3_object.package[0].key : null
  source_code_hash = local.image_uris[each.key] == null ? filebase64sha256(var.package.zip_path) : null
  runtime          = local.image_uris[each.key] == null ? var.package.runtime : null
  handler          = local.image_uris[each.key] == null ? "functions.handler.handler" : null
  image_uri        = local.image_uris[each.key]

  dynamic "image_config" {
    # one image serves both entry points: name the one this function runs
    for_each = local.image_uris[each.key] == null ? [] : ["functions.handler.handler"]
    content {
      command = [image_config.value]
    }
  }

  memory_size                    = each.value.memory_mb
  timeout                        = each.value.timeout_s
  reserved_concurrent_executions = each.value.reserved_concurrency

  ephemeral_storage {
    size = each.value.ephemeral_storage_mb
  }

  environment {
    # user variables first: they may override the common ones, never the function's identity.
    # A function with secrets has its whole environment sensitive (plan prints none of it);
    # the others' stays readable in the plan
    variables = merge(
      local.common_env,
      local.function_env[each.key],
      contains(local.secret_env_names, each.key) ? var.function_environment[each.key] : {},
      {
        RL_FABRIC_MODULES   = each.value.modules
        RL_FABRIC_FUNCTIONS = each.key
      },
      # a new version string changes the configuration, which publishes a new version
      # (an image pushed again under the same tag would not)
      each.value.version == "" ? {} : { RL_FABRIC_FUNCTION_VERSION = each.value.version },
    )
  }

  lifecycle {
    precondition {
      # checked at plan: at apply Lambda refused it after its log group and the role were made
      condition     = length("${var.name_prefix}${each.key}") <= 64 && can(regex("^[a-zA-Z0-9_-]+$", "${var.name_prefix}${each.key}"))
      error_message = "Lambda function names are at most 64 characters, letters, digits, '-' and '_': ${var.name_prefix}${each.key} (name_prefix + fabric name) is ${length("${var.name_prefix}${each.key}")} characters. Use a shorter name_prefix or name."
    }
    precondition {
      # a misspelt name would deploy the function without its secrets
      condition     = alltrue([for name in local.secret_env_names : contains(keys(var.functions), name)])
      error_message = "function_environment names functions that are not deployed: ${join(", ", [for name in local.secret_env_names : name if !contains(keys(var.functions), name)])}."
    }
    precondition {
      # as would a misspelt name here: the function would deploy without its settings
      condition     = alltrue([for name in keys(var.function_settings) : contains(keys(var.functions), name)])
      error_message = "function_settings names functions that are not deployed: ${join(", ", [for name in keys(var.function_settings) : name if !contains(keys(var.functions), name)])}."
    }
  }

  depends_on = [aws_cloudwatch_log_group.this, aws_iam_role_policy.this]
}

resource "aws_lambda_alias" "live" {
  for_each = aws_lambda_function.this

  name             = local.alias
  function_name    = each.value.function_name
  function_version = each.value.version
}

# Provisioned concurrency needs a version or alias: on the alias, it follows each publish.
resource "aws_lambda_provisioned_concurrency_config" "warm" {
  for_each = { for name, f in var.functions : name => f.warm if f.warm > 0 }

  function_name                     = aws_lambda_alias.live[each.key].function_name
  qualifier                         = aws_lambda_alias.live[each.key].name
  provisioned_concurrent_executions = each.value
}

# One function for the SQS path: records name any function, so none is allow-listed
# (RL_FABRIC_FUNCTIONS unset) and each cold start discovers them all.
resource "aws_lambda_function" "sqs_worker" {
  count = var.sqs_worker ? 1 : 0

  function_name = local.worker_name
  description   = "rl-fabric SQS worker: every function, results to the reply queue"
  role          = aws_iam_role.sqs_worker[0].arn
  architectures = [var.package.architecture]
  publish       = true

  package_type     = local.zip ? "Zip" : "Image"
  s3_bucket        = local.zip ? aws_s3_object.package[0].bucket : null
  s3_key           = local.zip ? aws_s3_object.package[0].key : null
  source_code_hash = local.zip ? filebase64sha256(var.package.zip_path) : null
  runtime          = local.zip ? var.package.runtime : null
  handler          = local.zip ? "functions.handler.sqs_handler" : null
  image_uri        = local.zip ? null : var.package.image_uri

  dynamic "image_config" {
    for_each = local.zip ? [] : ["functions.handler.sqs_handler"]
    content {
      command = [image_config.value]
    }
  }

  memory_size                    = local.worker_memory_mb
  timeout                        = local.worker_timeout_s
  reserved_concurrent_executions = var.sqs_worker_reserved_concurrency

  ephemeral_storage {
    size = local.worker_storage_mb
  }

  environment {
    # sensitive as a whole when one of its functions has secrets (function_environment)
    variables = merge(
      local.common_env,
      local.worker_env,
      length([for name in local.worker_functions : name if contains(local.secret_env_names, name)]) > 0 ? local.worker_secret_env : {},
      { RL_FABRIC_MODULES = local.worker_modules },
      var.reply_queue == null ? {} : { RL_FABRIC_REPLY_QUEUE_URL = var.reply_queue.url },
    )
  }

  lifecycle {
    precondition {
      condition     = length(local.worker_env_conflicts) == 0
      error_message = "the SQS worker serves ${join(", ", local.worker_functions)} in one Lambda, with one value per environment variable, and these are set to different values: ${join("; ", local.worker_env_conflicts)}. Give each one value, or give one of those functions its own image (functions[*].image_uri: the worker leaves it out), or turn the queue off (enable_queue = false)."
    }
  }

  depends_on = [aws_cloudwatch_log_group.sqs_worker, aws_iam_role_policy.sqs_worker]
}

resource "aws_lambda_alias" "sqs_worker" {
  count = var.sqs_worker ? 1 : 0

  name             = local.alias
  function_name    = aws_lambda_function.sqs_worker[0].function_name
  function_version = aws_lambda_function.sqs_worker[0].version
}
