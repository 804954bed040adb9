output "prefixes" {
  description = "Upstream key -> ECR repository prefix of its cache."
  value       = { for key, r in aws_ecr_pull_through_cache_rule.this : key => r.ecr_repository_prefix }
}

output "registry" {
  description = "The private registry host the caches live in."
  value       = "${data.aws_caller_identity.current.account_id}.dkr.ecr.${data.aws_region.current.name}.amazonaws.com"
}

output "url_templates" {
  description = "Upstream key -> image reference through the cache (fill in the upstream repository and tag)."
  value = {
    for key, r in aws_ecr_pull_through_cache_rule.this :
    key => "${r.registry_id}.dkr.ecr.${data.aws_region.current.name}.amazonaws.com/${r.ecr_repository_prefix}/<upstream-repository>:<tag>"
  }
}
