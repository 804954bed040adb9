output "function_names" {
  description = "Fabric name -> deployed function name."
  value       = { for name, f in aws_lambda_function.this : name => f.function_name }
}

output "function_arns" {
  description = "Fabric name -> function ARN (unqualified)."
  value       = { for name, f in aws_lambda_function.this : name => f.arn }
}

output "alias_arns" {
  description = "Fabric name -> ARN of the live alias (what clients invoke)."
  value       = { for name, a in aws_lambda_alias.live : name => a.arn }
}

output "alias_name" {
  description = "The alias every function is invoked through."
  value       = local.alias
}

output "sqs_worker_alias_arn" {
  description = "The SQS worker's live alias ARN; null without sqs_worker."
  value       = one(aws_lambda_alias.sqs_worker[*].arn)
  # an event source mapping is refused until the worker's role may read the queue
  depends_on = [aws_iam_role_policy.sqs_worker]
}

output "sqs_worker_timeout_s" {
  description = "The SQS worker's timeout (the input queue's visibility timeout must not be shorter)."
  value       = local.worker_timeout_s
}

output "role_arn" {
  description = "The functions' execution role."
  value       = aws_iam_role.this.arn
}
