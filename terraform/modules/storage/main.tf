locals {
  # S3 names: lowercase letters, digits, '-' and '.'; bucket_prefix is at most 37 characters
  bucket_prefix = substr(replace(replace(lower(var.name_prefix), "_", "-"), "/^-+/", ""), 0, 37)
}

resource "aws_s3_bucket" "this" {
  bucket        = var.bucket_name
  bucket_prefix = var.bucket_name == null && local.bucket_prefix != "" ? local.bucket_prefix : null
  force_destroy = var.force_destroy
}

resource "aws_s3_bucket_ownership_controls" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_public_access_block" "this" {
  bucket = aws_s3_bucket.this.id

  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_server_side_encryption_configuration" "this" {
  bucket = aws_s3_bucket.this.id

  # SSE-S3: readers need no KMS permissions
  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm = "AES256"
    }
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "this" {
  bucket = aws_s3_bucket.this.id

  # spilled payloads are only read by the call that spilled them
  rule {
    id     = "spill"
    status = "Enabled"

    filter {
      prefix = "spill/"
    }

    expiration {
      days = var.spill_expiration_days
    }
  }

  rule {
    id     = "trajectories"
    status = "Enabled"

    filter {
      prefix = "trajectories/"
    }

    transition {
      days          = var.trajectories_ia_days
      storage_class = "STANDARD_IA"
    }
  }

  rule {
    id     = "abort-incomplete-uploads"
    status = "Enabled"

    filter {
      prefix = ""
    }

    abort_incomplete_multipart_upload {
      days_after_initiation = 1
    }
  }
}

data "aws_iam_policy_document" "tls_only" {
  statement {
    sid       = "DenyInsecureTransport"
    effect    = "Deny"
    actions   = ["s3:*"]
    resources = [aws_s3_bucket.this.arn, "${aws_s3_bucket.this.arn}/*"]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }
}

resource "aws_s3_bucket_policy" "tls_only" {
  bucket = aws_s3_bucket.this.id
  policy = data.aws_iam_policy_document.tls_only.json

  # concurrent configuration calls on one bucket can fail with OperationAborted
  depends_on = [aws_s3_bucket_public_access_block.this]
}

resource "aws_dynamodb_table" "idempotency" {
  name                        = "${var.name_prefix}idempotency"
  billing_mode                = "PAY_PER_REQUEST"
  hash_key                    = "id"
  deletion_protection_enabled = var.table_deletion_protection

  attribute {
    name = "id"
    type = "S"
  }

  # Powertools idempotency writes the record's expiry (epoch seconds) here
  ttl {
    attribute_name = "expiration"
    enabled        = true
  }

  server_side_encryption {
    enabled = true
  }

  point_in_time_recovery {
    enabled = true
  }
}
