"""Kept importable for one release: Request and RequestStatus now live in
plugserve.datatypes.request, so that plugins and the Protocols need not import the
engine. Import them from plugserve.datatypes."""

from __future__ import annotations

from plugserve.datatypes.request import Request, RequestStatus

__all__ = ["Request", "RequestStatus"]
