terraform {
  required_version = ">= 1.5"

  required_providers {
    aws = {
      source = "hashicorp/aws"
      # 5.61 added aws_ecr_repository_creation_template
      version = "~> 5.61"
    }
  }
}
