output "function_names" {
  description = "Fabric name -> deployed Lambda function name."
  value       = module.functions.function_names
}

output "function_arns" {
  description = "Fabric name -> Lambda function ARN (unqualified)."
  value       = module.functions.function_arns
}

output "alias_arns" {
  description = "Fabric name -> ARN of its `live` alias, the one clients invoke."
  value       = module.functions.alias_arns
}

output "bucket" {
  description = "The storage bucket (spilled payloads under spill/, trajectories under trajectories/)."
  value       = module.storage.bucket_name
}

output "idempotency_table" {
  description = "The DynamoDB idempotency table."
  value       = module.storage.table_name
}

output "queue_urls" {
  description = "SQS queue URLs (in, out, dlq); null without enable_queue."
  value = var.enable_queue ? {
    in  = module.queue[0].in_url
    out = module.queue[0].out_url
    dlq = module.queue[0].dlq_url
  } : null
}

output "image_cache_prefixes" {
  description = "Upstream key -> ECR repository prefix of its pull-through cache; empty without enable_image_cache."
  value       = var.enable_image_cache ? module.image_cache[0].prefixes : {}
}

output "image_cache_url_templates" {
  description = "Upstream key -> image URL template through the cache; empty without enable_image_cache."
  value       = var.enable_image_cache ? module.image_cache[0].url_templates : {}
}
