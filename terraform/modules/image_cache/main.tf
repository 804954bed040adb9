data "aws_caller_identity" "current" {}

data "aws_region" "current" {}

locals {
  # ECR prefixes are lowercase and cannot end in a separator
  namespace = replace(lower(var.name_prefix), "/[-_.]+$/", "")
  prefixes  = { for key, u in var.upstreams : key => local.namespace == "" ? key : "${local.namespace}/${key}" }
}

resource "aws_ecr_pull_through_cache_rule" "this" {
  for_each = var.upstreams

  ecr_repository_prefix = local.prefixes[each.key]
  upstream_registry_url = each.value.upstream_registry_url
  credential_arn        = each.value.credential_arn

  lifecycle {
    precondition {
      # checked here so a bad key fails the plan, not the apply
      condition = (
        length(local.prefixes[each.key]) >= 2 && length(local.prefixes[each.key]) <= 30 &&
        can(regex("^(?:[a-z0-9]+(?:[._-][a-z0-9]+)*/)*[a-z0-9]+(?:[._-][a-z0-9]+)*$", local.prefixes[each.key]))
      )
      error_message = "ECR repository prefix ${local.prefixes[each.key]}: 2-30 characters, lowercase letters, digits, '.', '_', '-' and '/' (shorten name_prefix or the upstream key)."
    }
  }
}

# Settings of the repositories the cache creates on first pull (same prefix as its rule).
resource "aws_ecr_repository_creation_template" "this" {
  for_each = var.upstreams

  prefix               = local.prefixes[each.key]
  description          = "rl-fabric pull-through cache of ${each.value.upstream_registry_url}"
  applied_for          = ["PULL_THROUGH_CACHE"]
  image_tag_mutability = var.image_tag_mutability

  encryption_configuration {
    encryption_type = "AES256"
  }

  lifecycle_policy = jsonencode({
    rules = [{
      rulePriority = 1
      description  = "expire untagged images after ${var.untagged_expiration_days} days"
      selection = {
        tagStatus   = "untagged"
        countType   = "sinceImagePushed"
        countUnit   = "days"
        countNumber = var.untagged_expiration_days
      }
      action = { type = "expire" }
    }]
  })
}
