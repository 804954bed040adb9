variable "name_prefix" {
  description = "Prefix of the bucket (made S3-safe) and table names."
  type        = string
}

variable "bucket_name" {
  description = "An exact bucket name; null: name_prefix plus a unique suffix."
  type        = string
  default     = null
}

variable "spill_expiration_days" {
  description = "Objects under spill/ (payloads over the Lambda limit) are deleted after this many days."
  type        = number
  default     = 7

  validation {
    condition     = var.spill_expiration_days >= 1
    error_message = "spill_expiration_days must be >= 1."
  }
}

variable "trajectories_ia_days" {
  description = "Objects under trajectories/ move to STANDARD_IA after this many days (S3 needs >= 30)."
  type        = number
  default     = 30

  validation {
    condition     = var.trajectories_ia_days >= 30
    error_message = "trajectories_ia_days must be >= 30 (the STANDARD_IA minimum)."
  }
}

variable "force_destroy" {
  description = "Let terraform destroy delete a bucket that still has objects."
  type        = bool
  default     = false
}

variable "table_deletion_protection" {
  description = "Deletion protection on the idempotency table."
  type        = bool
  default     = false
}
