output "in_url" {
  description = "Input queue URL: send Invocation JSON here."
  value       = aws_sqs_queue.in.url
}

output "in_arn" {
  description = "Input queue ARN."
  value       = aws_sqs_queue.in.arn
}

output "out_url" {
  description = "Reply queue URL: Results arrive here."
  value       = aws_sqs_queue.out.url
}

output "out_arn" {
  description = "Reply queue ARN."
  value       = aws_sqs_queue.out.arn
}

output "dlq_url" {
  description = "Dead-letter queue URL (records received max_receive_count times)."
  value       = aws_sqs_queue.dlq.url
}

output "dlq_arn" {
  description = "Dead-letter queue ARN."
  value       = aws_sqs_queue.dlq.arn
}

output "event_source_mapping_uuid" {
  description = "The input queue -> worker mapping."
  value       = aws_lambda_event_source_mapping.in.uuid
}
