"""What services raise; the app turns each into an HTTP status with the message as `detail`."""

from __future__ import annotations


class ServiceError(Exception):
    status_code = 400

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class NotFound(ServiceError):
    status_code = 404


class Conflict(ServiceError):
    status_code = 409


class Invalid(ServiceError):
    status_code = 422


class Forbidden(ServiceError):
    status_code = 403


class TooLarge(ServiceError):
    status_code = 413


class QuotaExceeded(ServiceError):
    status_code = 429

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after
