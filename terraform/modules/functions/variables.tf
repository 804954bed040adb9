variable "name_prefix" {
  description = "Prefix of every name; a deployed function is name_prefix + its fabric name."
  type        = string
}

variable "package" {
  description = "The code every function runs (see the root module's variable of the same name)."
  type = object({
    type         = string
    zip_path     = optional(string)
    image_uri    = optional(string)
    runtime      = optional(string, "python3.11")
    architecture = optional(string, "x86_64")
  })

  validation {
    condition     = contains(["zip", "image"], var.package.type)
    error_message = "package.type must be \"zip\" or \"image\"."
  }
  validation {
    condition     = var.package.type != "zip" || var.package.zip_path != null
    error_message = "package.type \"zip\" needs package.zip_path."
  }
  validation {
    condition     = var.package.type != "image" || var.package.image_uri != null
    error_message = "package.type \"image\" needs package.image_uri."
  }
}

variable "functions" {
  description = "Fabric name -> function settings (see the root module's variable of the same name)."
  type = map(object({
    modules              = string
    memory_mb            = optional(number, 512)
    timeout_s            = optional(number, 30)
    warm                 = optional(number, 0)
    reserved_concurrency = optional(number, -1)
    ephemeral_storage_mb = optional(number, 512)
    description          = optional(string, "")
    version              = optional(string, "")
    image_uri            = optional(string)
    environment          = optional(map(string), {})
  }))

  validation {
    # the role's log statement needs at least one log group
    condition     = length(var.functions) > 0
    error_message = "functions: at least one function."
  }
}

variable "function_settings" {
  description = "Environment variables that are no secret by fabric name (as the root's), merged over functions[*].environment."
  type        = map(map(string))
  default     = {}
}

variable "function_environment" {
  description = "Secret environment variables by fabric name (as the root's): sensitive, never printed by plan."
  type        = map(map(string))
  default     = {}
  sensitive   = true
}

variable "log_retention_days" {
  description = "Retention of each function's log group."
  type        = number
  default     = 14

  validation {
    condition     = contains([0, 1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653], var.log_retention_days)
    error_message = "log_retention_days must be a value CloudWatch Logs accepts (0 = never expire, 1, 3, 5, 7, 14, 30, ...)."
  }
}

variable "idempotency_table_name" {
  description = "DynamoDB idempotency table (RL_FABRIC_IDEMPOTENCY_TABLE)."
  type        = string
}

variable "idempotency_table_arn" {
  description = "Its ARN: the only table the role may read and write."
  type        = string
}

variable "idempotency_ttl_s" {
  description = "RL_FABRIC_IDEMPOTENCY_TTL_S."
  type        = number
  default     = 3600
}

variable "spill_bucket_name" {
  description = "Bucket of payloads over the 6 MB Lambda limit (RL_FABRIC_SPILL_BUCKET)."
  type        = string
}

variable "spill_bucket_arn" {
  description = "Its ARN: the role may read spill/* and nothing else in it."
  type        = string
}

variable "sqs_worker" {
  description = "Also create <name_prefix>sqs-worker (functions.handler.sqs_handler), serving every function."
  type        = bool
  default     = false
}

variable "sqs_worker_memory_mb" {
  description = "The worker's memory; null: the largest of the functions'."
  type        = number
  default     = null
}

variable "sqs_worker_timeout_s" {
  description = "The worker's timeout; null: sqs_batch_size x the longest of the functions' (at most 900)."
  type        = number
  default     = null
}

variable "sqs_batch_size" {
  description = "Records per worker invocation (the event source mapping's batch_size)."
  type        = number
  default     = 10
}

variable "sqs_worker_reserved_concurrency" {
  description = "The worker's reserved concurrency (-1: unreserved)."
  type        = number
  default     = -1
}

variable "input_queue" {
  description = "The queue the worker consumes; null: no receive permissions."
  type = object({
    arn = string
  })
  default = null
}

variable "reply_queue" {
  description = "The queue the worker sends Results to (RL_FABRIC_REPLY_QUEUE_URL); null: none."
  type = object({
    url = string
    arn = string
  })
  default = null
}

variable "service_name" {
  description = "POWERTOOLS_SERVICE_NAME."
  type        = string
  default     = "rl-fabric"
}

variable "metrics_namespace" {
  description = "POWERTOOLS_METRICS_NAMESPACE (CloudWatch metrics namespace)."
  type        = string
  default     = "rl-fabric"
}
