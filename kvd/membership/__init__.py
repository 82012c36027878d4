"""Membership: who is alive, which instance it is, where it listens, and what this side
holds for it, as a pure machine (:mod:`kvd.membership.machine`) fed by every source that
learns such a fact (:class:`~kvd.membership.effects.Source`)."""
