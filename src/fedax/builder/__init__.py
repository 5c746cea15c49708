"""The builder: from a validated config (``fedax.spec``) to the pieces a run needs, the
same for every engine: the federated data set (``datasets``), the algorithm and its
aggregator chain (``build``), the privacy plan and its accountant (``privacy_plan``), the
secure aggregator (``secure_plan``) and the attack and compression plans (``features``).
The simulator, the runtime and the driver (``fedax.experiments``) call it."""
