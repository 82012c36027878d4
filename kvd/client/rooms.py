"""Sender / Receiver: the per-room objects an engine uses (SGLang's KVSender/KVReceiver shape)."""

from __future__ import annotations

import array
from typing import Any

import numpy as np
import numpy.typing as npt

from kvd.client.ring import Handle
from kvd.client.rpc import KvdClient
from kvd.errors import KvdError, KvdUnreachable, KVTransferError, ProtocolError, RoomError
from kvd.protocol import rpc
from kvd.protocol.codec import pack_indices
from kvd.rooms import UNKNOWN_ROOM, KVPoll

#: Every status kvd answers, by value: KVPoll, and UNKNOWN_ROOM for a room kvd does not know.
_BY_VALUE: dict[int, KVPoll | int] = {int(s): s for s in KVPoll} | {UNKNOWN_ROOM: UNKNOWN_ROOM}
#: The same, as an object array indexed by ``value - UNKNOWN_ROOM`` (one ``take`` turns
#: an int8 array of statuses into KVPoll members).
_BY_INDEX = np.array([_BY_VALUE[v] for v in range(UNKNOWN_ROOM, max(_BY_VALUE) + 1)],
                     dtype=object)
_U64 = np.dtype(np.uint64)


def _status(value: int) -> KVPoll | int:
    """KVPoll of one status value (UNKNOWN_ROOM stays -1); ProtocolError for a value that
    is no status."""
    try:
        return _BY_VALUE[value]
    except KeyError:
        raise _not_a_status(value) from None


def _statuses(values: list[int]) -> list[KVPoll | int]:
    """:func:`_status` of each value, in one map."""
    try:
        return list(map(_BY_VALUE.__getitem__, values))
    except KeyError as exc:
        raise _not_a_status(exc.args[0]) from None


def _statuses_of(values: npt.NDArray[np.int8]) -> list[KVPoll | int]:
    """:func:`_statuses` of an int8 array, in one ``take`` (no Python int per room)."""
    at = values - np.int8(UNKNOWN_ROOM)
    try:
        out: list[KVPoll | int] = _BY_INDEX.take(at.view(np.uint8)).tolist()
    except IndexError:
        bad = values[(at.view(np.uint8) >= len(_BY_INDEX))]
        raise _not_a_status(int(bad[0])) from None
    return out


def _not_a_status(value: object) -> ProtocolError:
    return ProtocolError(f"kvd answered room status {value!r}, which is none of KVPoll's "
                         f"values or UNKNOWN_ROOM")


def poll_array(client: KvdClient, rooms: npt.ArrayLike) -> npt.NDArray[np.int8]:
    """KVPoll values (int8, one per room; ``UNKNOWN_ROOM`` = -1) of ``rooms`` (64-bit
    unsigned ids, 1-D), read from kvd's status table without a syscall where it answers,
    and in ONE ``Poll`` RPC for the rest (every room when there is no table).

    What :func:`poll_many` answers, as an array; the same failure rules. ValueError for
    an id that is no 64-bit unsigned integer (a negative one, say), whatever carries it:
    a list, or an array of another dtype (numpy's cast would wrap a negative int64 to
    another room's id and truncate a float to one; case S19).
    """
    if type(rooms) is np.ndarray and rooms.dtype is _U64 and rooms.ndim == 1:
        ids = rooms  # the adapters' case: no conversion
    else:
        ids = _uint64_ids(rooms)
    read = client.read_statuses(ids)
    if read is None:
        statuses = np.asarray(_poll_socket(client, ids.tolist()), dtype=np.int8)
    else:
        statuses, misses = read
        if len(misses):
            statuses[misses] = _poll_socket(client, ids[misses].tolist())
    return _refused_failed(client, ids, statuses)


def _uint64_ids(rooms: npt.ArrayLike) -> npt.NDArray[np.uint64]:
    """``rooms`` as a 1-D uint64 array, exactly: ValueError for an id that is no integer
    in ``[0, 2**64)`` (an array of unsigned or signed integers is checked, never cast
    blindly; anything else goes id by id through :mod:`array`'s ``Q``, which refuses a
    negative, too large or non-integer one)."""
    why = ""
    if isinstance(rooms, np.ndarray) and rooms.dtype.kind == "O":
        rooms = rooms.reshape(-1).tolist()  # Python ints (or not): id by id below
    if isinstance(rooms, np.ndarray):
        kind = rooms.dtype.kind
        if kind == "u" or rooms.size == 0:
            return rooms.astype(np.uint64).reshape(-1)
        if kind == "i":
            if int(rooms.min()) >= 0:
                return rooms.astype(np.uint64).reshape(-1)
            why = f"{int(rooms.min())} is negative"
        else:
            why = f"an array of {rooms.dtype}"
    else:
        try:
            return np.frombuffer(array.array("Q", rooms), dtype=np.uint64)  # type: ignore[arg-type,type-var]
        except (OverflowError, TypeError, ValueError) as exc:
            why = str(exc)
    raise ValueError(f"room ids are integers in [0, 2**64): {why}")


def _refused_failed(client: KvdClient, ids: npt.NDArray[np.uint64],
                    statuses: npt.NDArray[np.int8]) -> npt.NDArray[np.int8]:
    """``statuses`` with every room that holds a ring refusal read Failed: a room call the
    engine did not wait for and kvd refused fails the room for the engine, whichever way
    it reads it (:meth:`KvdClient.ring_refused`; no work per room when there is none)."""
    refused = client.ring_refused(ids)  # kept across a reconnect too: no ring needed
    if refused is not None:
        statuses[refused] = int(KVPoll.Failed)
    return statuses


def _poll_socket(client: KvdClient, rooms: list[int]) -> list[int]:
    try:
        result: rpc.PollResult = client.call(rpc.Poll(rooms=rooms))
    except KvdUnreachable:
        return [int(KVPoll.Failed)] * len(rooms)
    _statuses(result.statuses)  # each one checked
    return result.statuses


def poll_many(client: KvdClient, rooms: list[int]) -> list[KVPoll | int]:
    """KVPoll of many rooms in ONE RPC (none where kvd's status table answers them all:
    :func:`poll_array`); a room kvd does not know gives ``UNKNOWN_ROOM`` (-1).

    If kvd cannot be reached every room reads ``Failed`` ("kvd unreachable"): an engine
    never hangs on a dead daemon. A malformed answer (a value that is no status, not one
    status per room) raises :class:`~kvd.errors.ProtocolError`.
    """
    if client.table is not None or client.ring is not None:
        return _statuses_of(poll_array(client, _ids_of(rooms)))
    try:
        result: rpc.PollResult = client.call(rpc.Poll(rooms=list(rooms)))
    except KvdUnreachable:
        return [KVPoll.Failed] * len(rooms)
    statuses = _statuses(result.statuses)
    if client.holds_refusals():  # kept across a dropped connection (K27)
        ids = _uint64_ids(rooms)
        return _statuses_of(_refused_failed(client, ids, np.array(statuses, dtype=np.int8)))
    return statuses


def _ids_of(rooms: list[int]) -> npt.NDArray[np.uint64] | list[int]:
    """``rooms`` as a uint64 array through :mod:`array` (a C loop over the list: about a
    third of numpy's conversion for small ids); the list itself where that refuses it
    (:func:`poll_array` then names the id that is no uint64)."""
    try:
        return np.frombuffer(array.array("Q", rooms), dtype=np.uint64)
    except (OverflowError, TypeError):
        return rooms


def wait_many(client: KvdClient, rooms: list[int], timeout: float) -> list[KVPoll | int]:
    """Block (in kvd, one RPC) until every room ended — and, on decode, its pages are
    releasable — or ``timeout`` s passed; returns their KVPoll (Failed if kvd is gone).
    A room holding a ring refusal reads Failed at once and is not waited for."""
    refused = None
    if rooms:
        refused = client.ring_refused(_uint64_ids(rooms))
    waited = list(rooms) if refused is None else \
        [r for r, bad in zip(rooms, refused.tolist(), strict=True) if not bad]
    out: list[KVPoll | int] = [KVPoll.Failed] * len(rooms)
    if waited:
        try:
            result = client.wait(waited, timeout)
        except KvdUnreachable:
            return out
        got = iter(_statuses(result.statuses))
        out = [KVPoll.Failed if refused is not None and refused[i] else next(got)
               for i in range(len(rooms))]
    return out


class _Room:
    def __init__(self, client: KvdClient, room: int) -> None:
        if not 0 <= room < 2**64:
            raise ValueError(f"room must be a 64-bit unsigned id, got {room}")
        self.client = client
        self.room = room
        self.lost = ""  # set once kvd was unreachable: the room is Failed for good
        self.lost_kind = ""  # the FailureKind value of ``lost`` ("": unreachable)
        self.epoch = client.epoch  # the kvd instance it lives in (KvdClient.epoch)
        #: kvd refused a call of this room sent through the ring without waiting (its
        #: create, an init, a send): the room reads Failed here, and its next send or init
        #: raises it
        self.refused: KvdError | None = None
        #: the create's handle while kvd may not have run it (ring path): the room's calls
        #: depend on it, and kvd runs none of them if it refused the create
        self._handle: Handle | None = None
        self._created = False  # kvd ran the handle's create (refused or not)

    @classmethod
    def attach(cls, client: KvdClient, room: int) -> Any:
        """A handle on a room that already exists in kvd (no RPC): poll, wait, abort, clear
        it from another thread or connection than the one that created it."""
        obj = cls.__new__(cls)
        _Room.__init__(obj, client, room)
        return obj

    def _gone(self) -> bool:
        """Whether the room is lost: kvd was unreachable, the client registered since
        with another kvd instance (kvd restarted, K27), which never knew the room, or the
        engine closed the client (:meth:`KvdClient.close`: kvd failed the room)."""
        if not self.lost and self.epoch != self.client.epoch:
            self.lost_kind, why = self.client.epoch_end(self.epoch)
            self.lost = f"room {self.room} is gone: {why}"
        return bool(self.lost)

    def _call(self, call: rpc.Call) -> Any:
        if self._gone():
            return None
        try:
            result = self.client.call(call)
        except KvdUnreachable as exc:
            self.lost = f"kvd unreachable: {exc}"
            return None
        return None if self._gone() else result  # reconnected to a new kvd inside the call

    def _create(self, call: rpc.SenderCreate | rpc.ReceiverCreate) -> None:
        """The room's create: through the ring without waiting (its refusal is read at
        the room's next call or poll, :meth:`refusal`), or over the socket, raising its
        refusal here (RoomError: the room is already active, ...)."""
        self._handle = self.client.create(call)

    def _live_handle(self) -> Handle | None:
        """The create's handle while kvd may not have run the create, else None; a
        refusal of the create (or of a call that depended on it) becomes the room's."""
        handle = self._handle
        if handle is None:
            return None
        settled, refusal = self.client.handle_state(handle)
        if refusal is not None:
            self.refused = self.refused or refusal
        elif settled:
            self._handle = None
            self.client.forget_handle(handle)
        return self._handle

    def _submit(self, call: rpc.RingCall, wait: bool = False) -> None:
        """``call`` through the client's ring (:meth:`KvdClient.submit`; the socket without
        one), depending on the room's create while kvd may not have run it; kvd
        unreachable marks the room lost, as :meth:`_call` does."""
        if self._gone():
            return
        try:
            handle = self._live_handle()
            if handle is not None and self.client.unborn(handle):
                return  # kvd refused the create: nothing of this handle's to act on
            self.client.submit(call, wait, handle)
        except KvdUnreachable as exc:
            self.lost = f"kvd unreachable: {exc}"

    def refusal(self) -> KvdError | None:
        """A refusal of an earlier call of this room that nobody waited for (ring path:
        its create, an init, a send): the room is failed for this engine from then on."""
        ring = self.client.ring
        if self.refused is not None or (
                (ring is None or ring.comp.head == ring.inbox.tail)
                and not self.client.holds_refusals()):
            return self.refused  # no completion unread, none kept: nothing new (no lock)
        if self._handle is not None:
            try:
                self._live_handle()
            except KvdUnreachable as exc:
                self.lost = f"kvd unreachable: {exc}"
        if self.refused is None:
            self.refused = self.client.room_refusal(self.room)
        return self.refused

    _refusal = refusal

    def _submit_raising(self, call: rpc.RingCall) -> None:
        """An init or a send: through the ring without waiting (depending on the create
        while kvd may not have run it), or over the socket; a refusal of the room's
        earlier calls that arrives meanwhile is raised (and kept, :attr:`refused`)."""
        try:
            self.client.submit(call, False, self._handle)
        except KvdUnreachable:
            raise
        except KvdError as exc:
            handle = self._handle
            if handle is not None and self.client.unborn(handle):
                self.refused = self.refused or exc  # the create's, raised by the ring
            raise

    def _raise_refusal(self) -> None:
        refusal = self._refusal()
        if refusal is not None:
            raise refusal

    def wait_created(self) -> None:
        """Before a read of the room's status (a poll, a wait; an adapter's own reads):
        while kvd may not have run this room's create (ring path), wait until it did (no
        longer than the socket ``Poll`` that would run it first), so that a refused
        create reads Failed, never the status of another incarnation of the room. At
        once otherwise. Never raises: kvd unreachable marks the room lost."""
        if self._handle is None or self._created or self.lost:
            return
        try:
            self.client.wait_created(self._handle)
        except KvdUnreachable as exc:
            self.lost = f"kvd unreachable: {exc}"
            return
        self._created = True

    def poll(self) -> KVPoll | int:
        """Current KVPoll of this room (``UNKNOWN_ROOM`` once cleared; ``Failed`` for good
        once kvd was unreachable or the client registered again with a restarted kvd --
        it does not know the room, K27 -- or kvd refused one of its calls sent through
        the ring, its create included). Read from kvd's status table when it answers (no
        syscall)."""
        self.wait_created()
        if self._refusal() is not None:  # kept across a reconnect too (K27)
            return KVPoll.Failed
        view = None if self._gone() else self.client.read_table_one(self.room)
        if view is not None:
            return _status(view[0])
        result = self._call(rpc.Poll(rooms=[self.room]))
        return KVPoll.Failed if result is None else _status(result.statuses[0])

    def wait(self, timeout: float) -> KVPoll | int:
        """Block until the room ends (and, on decode, its pages are releasable) or
        ``timeout`` s pass; returns its KVPoll. Longer than the client's RPC timeout
        is fine: the client waits in several calls. Failed at once when kvd refused one
        of its calls sent through the ring."""
        self.wait_created()
        if self._refusal() is not None:  # kept across a reconnect too (K27)
            return KVPoll.Failed
        result = self._call(rpc.Wait(rooms=[self.room], timeout=timeout))
        return KVPoll.Failed if result is None else _status(result.statuses[0])

    def releasable(self) -> bool:
        """May the engine reuse this room's pages? (Always True on prefill, and for a room
        whose create kvd refused: kvd holds none of its pages.)"""
        self.wait_created()
        if self._handle is not None and self.client.unborn(self._handle):
            return True
        view = None if self._gone() else self.client.read_table_one(self.room)
        if view is not None:
            return view[1]
        result = self._call(rpc.Poll(rooms=[self.room]))
        return result is None or self.room in result.releasable

    def failure(self) -> tuple[str, str]:
        """``(kind, reason)`` of the room's failure (``kind`` a FailureKind value;
        ``("", "room is not failed")`` otherwise)."""
        self.wait_created()
        if (refusal := self._refusal()) is not None:  # kept across a reconnect (K27)
            return rpc.error_kind(refusal), f"kvd refused a call of room {self.room}: {refusal}"
        result: rpc.PollResult | None = self._call(rpc.Poll(rooms=[self.room]))
        if result is None:
            return self.lost_kind or "unreachable", self.lost
        return (result.kinds.get(self.room, ""),
                result.reasons.get(self.room, "room is not failed"))

    def failure_reason(self) -> str:
        """Why the room failed (call after ``poll() == Failed``): names the room, the
        peer and the phase."""
        return self.failure()[1]

    def failure_exception(self) -> None:
        """Raise the room's failure as :class:`KVTransferError` (room, kind, reason), as
        SGLang's ``KVSender/KVReceiver.failure_exception`` does."""
        kind, reason = self.failure()
        raise KVTransferError(self.room, reason, kind)

    def abort(self, reason: str = "aborted by engine") -> None:
        """Fail the room on both sides with ``reason``; on decode, its pages stay
        unreleasable until the prefill side confirms no write is in flight."""
        self._submit(rpc.Abort(room=self.room, reason=reason,
                               bootstrap_addr=getattr(self, "bootstrap_addr", None),
                               dp_rank=getattr(self, "dp_rank", None)))

    def clear(self, timeout: float = 30.0, wait: bool = True) -> None:
        """Forget the room (an unfinished one is aborted). On decode, if a prefill write may
        still be in flight, this waits up to ``timeout`` s for the pages to become
        releasable (``timeout`` 0: not at all); raises RoomError if they still are not. A
        room whose create kvd refused (ring path) was never this handle's: nothing is
        sent (kvd's answer to the create is waited for if it has not run it yet).

        Without ``wait`` the Clear goes through the ring and this returns at once
        (:meth:`KvdClient.submit` not waited for; without a ring over the socket, raising
        its refusal): kvd runs it after the room's earlier calls and before any later
        call, a create of the same id included; a refusal (the pages not releasable yet,
        K06) is kept for the room, which then reads Failed until it is cleared again. So
        clear a room this way once it was read ended and releasable (both stay true: kvd
        cannot refuse it)."""
        handle = self._handle
        if handle is not None and not self.lost:  # wait for the create (clear waits anyway)
            try:
                self.client.handle_state(handle, wait=True)
            except KvdUnreachable as exc:
                self.lost = f"kvd unreachable: {exc}"
                return
            unborn = self.client.unborn(handle)
            self._handle = None
            self.client.forget_handle(handle)
            if unborn:  # kvd refused the create: the room (if any) is another handle's
                self.refused = None
                return
        if not wait:
            self._submit(rpc.Clear(room=self.room))
            self.refused = None  # the client drops the room's kept refusals once kvd ran it
            return
        try:
            self._submit(rpc.Clear(room=self.room), wait=True)
        except RoomError:
            if timeout <= 0:
                raise
            self._call(rpc.Wait(rooms=[self.room], timeout=timeout))
            self._submit(rpc.Clear(room=self.room), wait=True)
        # the client dropped the room's kept refusal with the Clear (KvdClient.submit): a
        self.refused = None  # room of the same id later starts clean


class Sender(_Room):
    """Prefill side of room ``room``. Raises RoomError if the room is already active.

    ``release_digest``: :func:`kvd.protocol.release.token_digest` of the opener's release
    token (32 bytes), so that the opener can end the room if no decode will claim it
    (K45/K46); empty: only the engine and the room's decode ranks can end it."""

    num_pages = 0  # pages announced by init(); a handle from attach() starts at 0
    sent = 0
    layered = False  # send_layers was used: kvd, not ``sent``, knows what is left

    def __init__(self, client: KvdClient, room: int, release_digest: bytes = b"") -> None:
        super().__init__(client, room)
        self.num_pages = 0
        self.sent = 0
        self._create(rpc.SenderCreate(room=room, release_digest=release_digest))
        self.epoch = client.epoch  # the kvd that took the create (it may have reconnected)

    def init(self, num_pages: int, aux_index: int, state_index: int = -1,
             window_pages: npt.ArrayLike | None = None) -> None:
        """Announce the room's total page count and its aux slot; for a hybrid model also
        its state slot (``state_index``) and the window pool's pages holding its last
        ``window_tokens`` tokens (``window_pages``, int, 1-D). They move with the last
        chunk."""
        self._raise_refusal()
        self.num_pages = num_pages
        win = b"" if window_pages is None else pack_indices(window_pages)
        self._submit_raising(rpc.SenderInit(room=self.room, num_pages=num_pages,
                                            aux_index=aux_index, state_index=state_index,
                                            window_pages=win))

    def send(self, page_indices: npt.ArrayLike, is_last: bool | None = None) -> None:
        """Send one chunk of source page indices (int, 1-D).

        The chunk that reaches ``num_pages`` is the last one (it carries aux);
        ``is_last`` overrides that. Through the client's ring (when it has one) this
        returns once the call is in the ring; a refusal comes back later (:attr:`refused`).
        """
        self._raise_refusal()
        if is_last is None and self.layered:
            raise ValueError(f"room {self.room}: pass is_last to send() once send_layers() "
                             f"was used (pages named there are not counted in sent)")
        pages = np.asarray(page_indices)
        self.sent += int(pages.size)
        last = self.sent >= self.num_pages if is_last is None else is_last
        self._submit_raising(rpc.SenderSend(room=self.room, pages=pack_indices(pages),
                                            is_last=last))

    def send_layers(self, page_indices: npt.ArrayLike, layers: tuple[int, int],
                    is_last: bool = False) -> None:
        """Hand kvd layers ``[lo, hi)`` of some pages as soon as the forward pass wrote
        them (layer streaming): kvd writes them while later layers compute.

        ``page_indices`` (int, 1-D): source pages the room never named (a new chunk; every
        layer of them must follow, in later calls), pages named before, or empty: every
        page named so far that still misses a layer. ``layers``: local layer indices of
        the pool this rank registered (its KV buffers' order, ``0 .. num_layers``), end
        exclusive. ``is_last``: the room's last send (it carries aux); every layer of every
        page must have been sent by then. A last send may name no layers (``lo == hi``) and
        no pages: it finishes a room whose every layer was sent, carrying aux (and a hybrid
        model's state). Raises :class:`~kvd.errors.RoomError` naming what is wrong, and the
        room fails (kind ``layout``), for a layer sent twice for a page, a range that is
        empty (but on such a last send), reversed or ends past the pool's layers, pages
        mixing new and named ones, no pages before the room named any, or a last send that
        leaves layers unsent (the message names which pages miss which layers);
        :class:`~kvd.errors.RoomError` without failing the room for a send after the last.
        ValueError (nothing sent) for a negative layer index. After this, :meth:`send`
        needs an explicit ``is_last`` (ValueError otherwise): pages named here are not in
        ``sent``."""
        self.wait_created()  # over the socket: no record to depend on the create
        if self._handle is not None and self.client.unborn(self._handle):
            self._raise_refusal()
        pages = np.asarray(page_indices, dtype=np.int64).reshape(-1)
        lo, hi = layers
        if lo < 0 or hi < 0:
            raise ValueError(f"room {self.room}: layers [{lo}, {hi}): layer indices are "
                             f"local layers of the pool, 0 or more")
        self.layered = True
        self.client.call(rpc.SenderSendLayers(room=self.room, pages=pack_indices(pages),
                                              layer_start=int(lo), layer_end=int(hi),
                                              is_last=is_last))


class Receiver(_Room):
    """Decode side of room ``room``, fed by the prefill instance at ``bootstrap_addr``.

    ``dp_rank`` names the prefill DP group (default: ``room % prefill_dp_size``).
    """

    def __init__(self, client: KvdClient, room: int, bootstrap_addr: str,
                 dp_rank: int | None = None) -> None:
        super().__init__(client, room)
        self.bootstrap_addr, self.dp_rank = bootstrap_addr, dp_rank
        self._create(rpc.ReceiverCreate(room=room, bootstrap_addr=bootstrap_addr,
                                        dp_rank=dp_rank))
        self.epoch = client.epoch  # the kvd that took the create (it may have reconnected)

    def init(self, dst_page_indices: npt.ArrayLike, aux_index: int,
             first_page: int = 0, state_index: int = -1,
             window_pages: npt.ArrayLike | None = None) -> None:
        """Give the destination pages (int, 1-D) and the aux slot for this room.

        ``first_page``: how many of the room's leading pages this decode already holds
        (a local prefix-cache hit); ``dst_page_indices[0]`` receives room page
        ``first_page``, and the prefill writes nothing before it. Hybrid models:
        ``state_index``, the state slot receiving the room's state, and ``window_pages``
        (int, 1-D), the window pool's pages receiving its window, in the prefill's order.
        Through the client's ring, as :meth:`Sender.send`."""
        self._raise_refusal()
        win = b"" if window_pages is None else pack_indices(window_pages)
        self._submit_raising(rpc.ReceiverInit(room=self.room,
                                              dst_pages=pack_indices(dst_page_indices),
                                              aux_index=aux_index, first_page=first_page,
                                              state_index=state_index, window_pages=win))
