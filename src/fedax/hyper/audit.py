"""The upload audit, now in ``fedax.federated.audit`` (kept here for older imports)."""

from fedax.federated._audit import SumAudit, audit_sums, unprivatized_sums

__all__ = ["SumAudit", "audit_sums", "unprivatized_sums"]
