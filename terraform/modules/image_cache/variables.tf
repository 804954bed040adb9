variable "name_prefix" {
  description = "Namespace of the cache prefixes: <name_prefix without a trailing -/_>/<upstream key>."
  type        = string
}

variable "upstreams" {
  description = "Upstream key -> registry (credential_arn: a Secrets Manager secret named ecr-pullthroughcache/..., for registries that need a login such as Docker Hub)."
  type = map(object({
    upstream_registry_url = string
    credential_arn        = optional(string)
  }))
  default = {
    "ecr-public" = { upstream_registry_url = "public.ecr.aws" }
  }
}

variable "untagged_expiration_days" {
  description = "Untagged images in the cached repositories are deleted after this many days."
  type        = number
  default     = 14

  validation {
    condition     = var.untagged_expiration_days >= 1
    error_message = "untagged_expiration_days must be >= 1."
  }
}

variable "image_tag_mutability" {
  description = "Tag mutability of the cached repositories (IMMUTABLE stops the cache from following a moved upstream tag)."
  type        = string
  default     = "MUTABLE"

  validation {
    condition     = contains(["MUTABLE", "IMMUTABLE"], var.image_tag_mutability)
    error_message = "image_tag_mutability must be MUTABLE or IMMUTABLE."
  }
}
