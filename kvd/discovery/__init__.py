"""Fleet discovery: where the prefill ranks an instance name stands for listen, and who
they are now.

One module per source behind the small interface of :mod:`kvd.discovery.base`:

* ``bootstrap`` (the default): SGLang's ``/route`` lookups on the prefill's bootstrap
  server (:mod:`kvd.discovery.bootstrap`) and the prefill's ``PUT /route``
  (``kvd.daemon.prefill``); liveness from heartbeats.
* ``etcd`` (:mod:`kvd.discovery.etcd`): each prefill rank puts its registration under a
  lease in etcd and keeps it alive; decodes read and *watch* the cluster's prefix, so a
  restart (a new instance put) or a death (lease expiry: a delete) reaches every decode
  as one watch event (:mod:`kvd.discovery.events`).

Pure parts (key layout, event decoding, lease and backoff timing) have no I/O and take
``now``; the etcd HTTP client (:mod:`kvd.discovery.etcd_client`) is the only module
that talks to etcd. docs/discovery.md explains the design and the choice of client.
"""
