variable "name_prefix" {
  description = "Prefix of the queue names (<prefix>in, <prefix>out, <prefix>in-dlq)."
  type        = string
}

variable "function_arn" {
  description = "What consumes the input queue: the sqs-worker's live alias ARN."
  type        = string
}

variable "function_timeout_s" {
  description = "That function's timeout."
  type        = number
}

variable "visibility_timeout_s" {
  description = "Visibility timeout of the input queue; null: 6 x function_timeout_s (the AWS advice), at most 12 hours."
  type        = number
  default     = null
}

variable "max_receive_count" {
  description = "Receives before a record goes to the dead-letter queue; keep it >= the functions' retry.max_attempts."
  type        = number
  default     = 5

  validation {
    condition     = var.max_receive_count >= 1 && var.max_receive_count <= 1000
    error_message = "max_receive_count must be between 1 and 1000."
  }
}

variable "batch_size" {
  description = "Records per worker invocation."
  type        = number
  default     = 10

  validation {
    condition     = var.batch_size >= 1 && var.batch_size <= 10000
    error_message = "batch_size must be between 1 and 10000."
  }
}

variable "maximum_batching_window_in_seconds" {
  description = "How long Lambda gathers records before invoking (0: at once; needed > 0 for batch_size > 10)."
  type        = number
  default     = 0

  validation {
    condition     = var.maximum_batching_window_in_seconds >= 0 && var.maximum_batching_window_in_seconds <= 300
    error_message = "maximum_batching_window_in_seconds must be between 0 and 300."
  }
}

variable "maximum_concurrency" {
  description = "Cap on concurrent worker invocations from the queue (2-1000); null: no cap."
  type        = number
  default     = null

  validation {
    # a conditional, not ||: terraform < 1.12 evaluates both sides, and null >= 2 is an error
    condition     = var.maximum_concurrency == null ? true : var.maximum_concurrency >= 2 && var.maximum_concurrency <= 1000
    error_message = "maximum_concurrency must be null or between 2 and 1000."
  }
}

variable "message_retention_s" {
  description = "Retention of the in and out queues (the dead-letter queue keeps 14 days)."
  type        = number
  default     = 345600
}
