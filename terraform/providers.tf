provider "aws" {
  region = var.region

  default_tags {
    tags = local.default_tags
  }
}

# The package's upload only (modules/functions): S3 takes at most 10 tags on an object, and
# default_tags go on every resource that takes tags, so more than 9 of the user's failed it.
provider "aws" {
  alias  = "package"
  region = var.region
}
