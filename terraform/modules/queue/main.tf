locals {
  visibility_timeout_s = coalesce(var.visibility_timeout_s, min(43200, 6 * var.function_timeout_s))
}

resource "aws_sqs_queue" "dlq" {
  name                      = "${var.name_prefix}in-dlq"
  message_retention_seconds = 1209600
  sqs_managed_sse_enabled   = true
}

resource "aws_sqs_queue" "in" {
  name                       = "${var.name_prefix}in"
  visibility_timeout_seconds = local.visibility_timeout_s
  message_retention_seconds  = var.message_retention_s
  sqs_managed_sse_enabled    = true

  redrive_policy = jsonencode({
    deadLetterTargetArn = aws_sqs_queue.dlq.arn
    maxReceiveCount     = var.max_receive_count
  })

  lifecycle {
    precondition {
      # otherwise a record reappears while the worker still runs it (and Lambda refuses the mapping)
      condition     = local.visibility_timeout_s >= var.function_timeout_s
      error_message = "the input queue's visibility timeout must be >= the worker's timeout."
    }
  }
}

# Only the input queue may send to the dead-letter queue.
resource "aws_sqs_queue_redrive_allow_policy" "dlq" {
  queue_url = aws_sqs_queue.dlq.url

  redrive_allow_policy = jsonencode({
    redrivePermission = "byQueue"
    sourceQueueArns   = [aws_sqs_queue.in.arn]
  })
}

resource "aws_sqs_queue" "out" {
  name                      = "${var.name_prefix}out"
  message_retention_seconds = var.message_retention_s
  sqs_managed_sse_enabled   = true
}

resource "aws_lambda_event_source_mapping" "in" {
  event_source_arn                   = aws_sqs_queue.in.arn
  function_name                      = var.function_arn
  batch_size                         = var.batch_size
  maximum_batching_window_in_seconds = var.maximum_batching_window_in_seconds
  # the handler lists retryable records in batchItemFailures; the rest of the batch is done
  function_response_types = ["ReportBatchItemFailures"]

  lifecycle {
    precondition {
      condition     = var.batch_size <= 10 || var.maximum_batching_window_in_seconds > 0
      error_message = "a batch_size over 10 needs maximum_batching_window_in_seconds > 0 (an SQS rule)."
    }
  }

  dynamic "scaling_config" {
    for_each = var.maximum_concurrency == null ? [] : [var.maximum_concurrency]
    content {
      maximum_concurrency = scaling_config.value
    }
  }
}
