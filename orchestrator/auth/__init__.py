"""Who calls the control plane and what they may do: roles and the actions each allows
(``orchestrator.auth.roles``, pure), and bearer tokens stored hashed in Redis (``orchestrator.auth.tokens``).

Errors, every one a :class:`~orchestrator.errors.SagaError`::

    SagaError
    ├── Forbidden            an identity's role does not allow an action (names the roles that would)
    ├── RoleUnknown          a role name that is not one of viewer, author, approver, operator, admin
    ├── TokenNameInvalid     a token name or tenant with characters a name may not hold
    ├── TokenNameTaken       a live token already has that name
    └── TokenNotFound        no live token has that name, and no token that id
"""
