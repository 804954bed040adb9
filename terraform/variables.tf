# `fabric deploy --backend lambda` writes region, name_prefix, package and functions into
# fabric.auto.tfvars.json; the rest keep their defaults unless set by hand. A variable set in
# two files takes the value of the last one Terraform reads, whole (*.auto.tfvars after
# terraform.tfvars): set those four only through deploy, and a function's environment in
# function_settings and function_environment, which deploy never writes.

variable "region" {
  description = "AWS region of every resource."
  type        = string
  default     = "us-east-1"
}

variable "name_prefix" {
  description = "Prefix of every resource name; a deployed function is name_prefix + its fabric name."
  type        = string
  default     = "rl-fabric-"

  validation {
    condition     = can(regex("^[a-zA-Z0-9-_]*$", var.name_prefix)) && length(var.name_prefix) <= 40
    error_message = "name_prefix: letters, digits, '-' and '_' only, at most 40 characters."
  }
}

variable "package" {
  description = "The code every function runs: a zip (zip_path) or a container image (image_uri)."
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
  validation {
    condition     = contains(["x86_64", "arm64"], var.package.architecture)
    error_message = "package.architecture must be \"x86_64\" or \"arm64\"."
  }
}

variable "functions" {
  description = "The fabric functions to deploy, keyed by fabric name (see README.md for the attributes)."
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
    max_attempts         = optional(number, 3)
  }))

  validation {
    condition     = length(var.functions) > 0
    error_message = "functions: deploy at least one function."
  }
  validation {
    condition     = alltrue([for f in values(var.functions) : f.timeout_s >= 1 && f.timeout_s <= 900])
    error_message = "functions[*].timeout_s must be between 1 and 900 (the Lambda maximum)."
  }
  validation {
    condition     = alltrue([for f in values(var.functions) : f.memory_mb >= 128 && f.memory_mb <= 10240])
    error_message = "functions[*].memory_mb must be between 128 and 10240."
  }
  validation {
    condition     = alltrue([for f in values(var.functions) : f.warm >= 0])
    error_message = "functions[*].warm (provisioned concurrency) must be >= 0."
  }
  validation {
    condition     = alltrue([for f in values(var.functions) : f.reserved_concurrency >= -1])
    error_message = "functions[*].reserved_concurrency must be -1 (unreserved) or >= 0."
  }
  validation {
    # Lambda refuses more provisioned than reserved concurrency
    condition     = alltrue([for f in values(var.functions) : f.reserved_concurrency < 0 || f.warm <= f.reserved_concurrency])
    error_message = "functions[*].warm must not exceed reserved_concurrency when that is set (>= 0)."
  }
  validation {
    condition     = alltrue([for f in values(var.functions) : f.ephemeral_storage_mb >= 512 && f.ephemeral_storage_mb <= 10240])
    error_message = "functions[*].ephemeral_storage_mb must be between 512 and 10240."
  }
  validation {
    # the input queue's maxReceiveCount (1 to 1000) is the most of them
    condition     = alltrue([for f in values(var.functions) : f.max_attempts >= 1 && f.max_attempts <= 1000])
    error_message = "functions[*].max_attempts (the function's retry.max_attempts) must be between 1 and 1000."
  }
}

variable "function_settings" {
  description = "Environment variables that are no secret (a judge's model, a log level), keyed by fabric name, merged over functions[*].environment. fabric deploy never writes it: set it in a tfvars file of your own (deploy's fabric.auto.tfvars.json replaces a functions value set elsewhere whole). Printed by terraform plan."
  type        = map(map(string))
  default     = {}
}

variable "function_environment" {
  description = "Secret environment variables (API keys), keyed by fabric name: sensitive, so terraform plan does not print them. functions[*].environment is printed: keep it for settings that are no secret."
  type        = map(map(string))
  default     = {}
  sensitive   = true
}

variable "tags" {
  description = "Tags on every resource (the provider's default_tags), with managed-by = rl-fabric added. fabric deploy does not write it."
  type        = map(string)
  default     = {}
}

variable "log_retention_days" {
  description = "Retention of the functions' CloudWatch log groups."
  type        = number
  default     = 14
}

variable "idempotency_ttl_s" {
  description = "How long an idempotency record lives (RL_FABRIC_IDEMPOTENCY_TTL_S)."
  type        = number
  default     = 3600

  validation {
    condition     = var.idempotency_ttl_s >= 1
    error_message = "idempotency_ttl_s must be >= 1."
  }
}

variable "spill_expiration_days" {
  description = "Spilled payloads (s3://bucket/spill/) are deleted after this many days."
  type        = number
  default     = 7
}

variable "bucket_force_destroy" {
  description = "Let terraform destroy delete the storage bucket with the objects terraform does not manage (spilled payloads, trajectories); apply it before the destroy. Off: the destroy fails on a bucket that holds any."
  type        = bool
  default     = false
}

variable "enable_queue" {
  description = "Create the SQS path: in/out/dead-letter queues and an sqs-worker function."
  type        = bool
  default     = false
}

variable "enable_image_cache" {
  description = "Create ECR pull-through cache rules for the environments' container images."
  type        = bool
  default     = false
}

variable "image_cache_upstreams" {
  description = "Pull-through cache upstreams, keyed by repository prefix (under name_prefix)."
  type = map(object({
    upstream_registry_url = string
    credential_arn        = optional(string)
  }))
  default = {
    "ecr-public" = { upstream_registry_url = "public.ecr.aws" }
  }
}
