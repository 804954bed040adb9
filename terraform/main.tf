locals {
  # records per sqs-worker invocation: sizes the worker's timeout and the event source mapping
  sqs_batch_size = 10
  # the sqs-worker leaves a retryable record on the input queue until its function's
  # retry.max_attempts receives, then replies the failure: a redrive that gives up sooner
  # dead-letters it unanswered. A receive that Lambda throttled counts too, so 5 more (AWS's
  # advice for a Lambda consumer's queue) let a throttled last attempt still be replied;
  # they also leave room for a reply that could not be sent. SQS allows at most 1000
  max_receive_count = min(1000, max([for f in values(var.functions) : f.max_attempts]...) + 5)
  # the user's tags, with the one that says who manages these: fabric deploy writes no tags
  # (a variable set in its fabric.auto.tfvars.json replaces the user's, whole)
  default_tags = merge(var.tags, { "managed-by" = "rl-fabric" })
}

module "storage" {
  source = "./modules/storage"

  name_prefix           = var.name_prefix
  spill_expiration_days = var.spill_expiration_days
  force_destroy         = var.bucket_force_destroy
}

module "functions" {
  source = "./modules/functions"
  providers = {
    aws         = aws
    aws.package = aws.package
  }

  name_prefix            = var.name_prefix
  package                = var.package
  functions              = var.functions
  function_settings      = var.function_settings
  function_environment   = var.function_environment
  log_retention_days     = var.log_retention_days
  idempotency_table_name = module.storage.table_name
  idempotency_table_arn  = module.storage.table_arn
  idempotency_ttl_s      = var.idempotency_ttl_s
  spill_bucket_name      = module.storage.bucket_name
  spill_bucket_arn       = module.storage.bucket_arn

  sqs_worker     = var.enable_queue
  sqs_batch_size = local.sqs_batch_size
  # objects built from a known condition: "given or not" is known at plan time even
  # while the queue ARNs are not
  input_queue = var.enable_queue ? { arn = module.queue[0].in_arn } : null
  reply_queue = var.enable_queue ? { url = module.queue[0].out_url, arn = module.queue[0].out_arn } : null
}

module "queue" {
  source = "./modules/queue"
  count  = var.enable_queue ? 1 : 0

  name_prefix        = var.name_prefix
  function_arn       = module.functions.sqs_worker_alias_arn
  function_timeout_s = module.functions.sqs_worker_timeout_s
  batch_size         = local.sqs_batch_size
  max_receive_count  = local.max_receive_count
}

module "image_cache" {
  source = "./modules/image_cache"
  count  = var.enable_image_cache ? 1 : 0

  name_prefix = var.name_prefix
  upstreams   = var.image_cache_upstreams
}
