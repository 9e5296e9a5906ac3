"""Failure diagnosis, apart from the hot path: a collective that timed out named by the rank
that never arrived and where it was last seen (:mod:`.arrival`, :mod:`.collector`,
:mod:`.waiting`), debug mode's check that every rank issues the same collective
(:mod:`.debug`), set-up agreement by digest (:mod:`.agree`), group timeouts
(:mod:`.timeouts`) and NCCL hangs read from torch's flight recorder (:mod:`.flight`)."""
