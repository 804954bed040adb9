terraform {
  required_version = ">= 1.5"

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = "~> 5.0"
      # the package's upload: a provider without default_tags (S3 objects take 10 tags at most)
      configuration_aliases = [aws.package]
    }
  }
}
