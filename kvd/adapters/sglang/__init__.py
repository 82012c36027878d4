"""kvd as an SGLang transfer backend (``--disaggregation-transfer-backend kvd``).

:mod:`.plugin` registers the backend through SGLang's plugin framework; :mod:`.conn`
holds the classes (they subclass SGLang's, so they import SGLang); :mod:`.kvargs` is the
pure ``KVArgs`` -> kvd registration.
"""
