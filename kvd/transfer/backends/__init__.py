"""Transfer backends behind one interface (:mod:`.base`): ``mooncake`` (the real
transfer engine, the only module importing ``mooncake``) and ``fake`` (in-process
copies for the in-process test tier)."""
