output "bucket_name" {
  description = "The storage bucket."
  value       = aws_s3_bucket.this.bucket
}

output "bucket_arn" {
  description = "Its ARN."
  value       = aws_s3_bucket.this.arn
}

output "table_name" {
  description = "The idempotency table."
  value       = aws_dynamodb_table.idempotency.name
}

output "table_arn" {
  description = "Its ARN."
  value       = aws_dynamodb_table.idempotency.arn
}
