#!/usr/bin/env node
// The npm `etcd3` client (over @grpc/grpc-js, an HTTP/2 stack independent of
// ours and of grpcio) against one server: KV, txn, leases and keepalive,
// watch, lock, election and etcd's error mapping.
//
//   node etcd3_suite.js 127.0.0.1:PORT
//
// Prints one JSON object {"ok", "endpoint", "results": {step: {...}}, "errors":
// {step: message}} on stdout; exits 0 only when every step passed (1 when a
// step failed, 2 on bad usage). Every wait is bounded and the client is closed
// at the end, so the process always ends by itself.
//
// Steps can be left out with SKIP_STEPS=a,b (tests/compat/test_node_etcd3.py
// does not; it helps when looking into one step by hand).

'use strict';

const { noop } = require('cockatiel');
const { Etcd3 } = require('etcd3');

const STEP_TIMEOUT_MS = 15000;
const CALL_DEADLINE_MS = 10000;
const RUN = `n${process.pid}-${Date.now()}`; // keys of this run, so reruns on one server don't mix

function withTimeout(promise, ms, what) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`timed out after ${ms} ms: ${what}`)), ms);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

// Resolves with the first value `emitter` emits on `event` (or with `pred`
// true), rejects on timeout.
function nextEvent(emitter, event, ms, what, pred = () => true) {
  return withTimeout(
    new Promise((resolve) => {
      const on = (...args) => {
        if (pred(...args)) {
          emitter.removeListener(event, on);
          resolve(args);
        }
      };
      emitter.on(event, on);
    }),
    ms,
    what,
  );
}

// Polls `pred` every 20 ms; rejects when it is still false after `ms`.
async function waitFor(pred, ms, what) {
  const deadline = Date.now() + ms;
  while (!pred()) {
    if (Date.now() >= deadline) {
      throw new Error(`timed out after ${ms} ms waiting until: ${what}`);
    }
    await new Promise((r) => setTimeout(r, 20));
  }
}

function check(cond, message) {
  if (!cond) {
    throw new Error(`check failed: ${message}`);
  }
}

function eq(actual, expected, what) {
  const a = JSON.stringify(actual);
  const e = JSON.stringify(expected);
  check(a === e, `${what}: got ${a}, want ${e}`);
}

// What an error looks like to the caller: the class the package mapped it to
// (from etcd's message or the gRPC code) and its message, which keeps grpc-js's
// "CODE NAME: details" form.
function describeError(err) {
  return { class: err && err.constructor ? err.constructor.name : typeof err, message: String(err && err.message) };
}

async function expectError(promise, what) {
  try {
    await promise;
  } catch (err) {
    return describeError(err);
  }
  throw new Error(`${what}: expected an error, the call succeeded`);
}

const steps = {
  async status(client) {
    const st = await client.maintenance.status();
    check(typeof st.version === 'string' && st.version.length > 0, `status.version ${st.version}`);
    return { version: st.version, leader_set: st.leader !== '0' && st.leader !== undefined };
  },

  async put_get(client) {
    const k = `${RUN}/kv/str`;
    const put = await client.put(k).value('hello');
    const got = await client.get(k).string();
    eq(got, 'hello', 'get string');
    const prev = await client.put(k).value('hello2').getPrevious();
    eq(prev && prev.value.toString(), 'hello', 'put prevKv');
    const missing = await client.get(`${RUN}/kv/missing`).string();
    eq(missing, null, 'get of a missing key');
    const exists = await client.get(k).exists();

    const bk = `${RUN}/kv/buf`;
    const bytes = Buffer.from([0, 1, 2, 0x7f, 0x80, 0xfe, 0xff]);
    await client.put(bk).value(bytes);
    const buf = await client.get(bk).buffer();
    check(Buffer.isBuffer(buf), 'get buffer returns a Buffer');
    eq(buf.toString('hex'), bytes.toString('hex'), 'buffer round trip');

    const num = `${RUN}/kv/num`;
    await client.put(num).value(42);
    const n = await client.get(num).number();
    eq(n, 42, 'number round trip');

    const res = await client.get(k).exec();
    const kv = res.kvs[0];
    return {
      string: got,
      previous: prev.value.toString(),
      missing,
      exists,
      buffer_hex: buf.toString('hex'),
      number: n,
      version: kv.version,
      create_lt_mod: BigInt(kv.create_revision) < BigInt(kv.mod_revision),
      header_revision_gt_put: BigInt(res.header.revision) > BigInt(put.header.revision),
    };
  },

  async get_all(client) {
    const p = `${RUN}/pfx/`;
    // Values run the other way round from keys, to tell the sorts apart.
    const names = ['a', 'b', 'c', 'd', 'e'];
    for (const [i, name] of names.entries()) {
      await client.put(p + name).value(`v${names.length - i}`);
    }
    await client.put(`${RUN}/pfy`).value('outside the prefix');
    const all = await client.getAll().prefix(p).strings();
    const count = await client.getAll().prefix(p).count();
    const keysDesc = await client.getAll().prefix(p).sort('Key', 'Descend').limit(3).keys();
    const byValue = await client.getAll().prefix(p).sort('Value', 'Ascend').limit(2).strings();
    const limited = await client.getAll().prefix(p).limit(2).exec();
    const created = await client.getAll().prefix(p).sort('Create', 'Descend').limit(1).keys();
    eq(count, 5, 'count');
    eq(keysDesc, [`${p}e`, `${p}d`, `${p}c`], 'sort Key Descend limit 3');
    return {
      all: Object.fromEntries(Object.entries(all).map(([key, v]) => [key.slice(p.length), v])),
      count,
      keys_desc_limit3: keysDesc.map((key) => key.slice(p.length)),
      by_value_limit2: Object.entries(byValue).map(([key, v]) => [key.slice(p.length), v]),
      limit2_more: limited.more,
      limit2_count: limited.count,
      limit2_kvs: limited.kvs.length,
      last_created: created.map((key) => key.slice(p.length)),
    };
  },

  async delete(client) {
    const p = `${RUN}/del/`;
    for (const name of ['a', 'b', 'c']) {
      await client.put(p + name).value(name.toUpperCase());
    }
    const one = await client.delete().key(`${p}a`);
    const none = await client.delete().key(`${p}nope`);
    const prev = await client.delete().prefix(p).getPrevious();
    const left = await client.getAll().prefix(p).count();
    return {
      deleted_one: one.deleted,
      deleted_missing: none.deleted,
      prefix_previous: prev.map((kv) => [kv.key.toString().slice(p.length), kv.value.toString()]),
      left,
    };
  },

  async txn(client) {
    const k = `${RUN}/txn/k`;
    await client.put(k).value('v1');
    const hit = await client
      .if(k, 'Value', '==', 'v1')
      .then(client.put(k).value('v2'), client.get(k))
      .else(client.put(`${RUN}/txn/else`).value('ran'))
      .commit();
    const afterHit = await client.get(k).string();
    const miss = await client
      .if(k, 'Value', '==', 'v1')
      .then(client.put(k).value('never'))
      .else(client.get(k), client.put(`${RUN}/txn/else`).value('ran'))
      .commit();
    const afterMiss = await client.get(k).string();
    const elseKey = await client.get(`${RUN}/txn/else`).string();
    const missRange = miss.responses[0].response_range;
    // A compare on a key that doesn't exist: its version is 0.
    const absent = await client.if(`${RUN}/txn/absent`, 'Version', '==', 0).then().commit();
    const multi = await client
      .if(k, 'Value', '==', 'v2')
      .and(k, 'Version', '>', 1)
      .and(k, 'Mod', '>', 0)
      .then(client.delete().key(k))
      .commit();
    return {
      hit_succeeded: hit.succeeded,
      hit_responses: hit.responses.map((r) => r.response),
      hit_range_value: hit.responses[1].response_range.kvs[0].value.toString(),
      after_hit: afterHit,
      miss_succeeded: miss.succeeded,
      miss_responses: miss.responses.map((r) => r.response),
      miss_range_value: missRange.kvs[0].value.toString(),
      after_miss: afterMiss,
      else_key: elseKey,
      absent_version_zero: absent.succeeded,
      multi_compare_succeeded: multi.succeeded,
      multi_deleted: multi.responses[0].response_delete_range.deleted,
    };
  },

  async lease(client) {
    const lease = client.lease(3); // keepalive every ttl/3 = 1 s
    let lost = null;
    lease.on('lost', (err) => {
      lost = describeError(err);
    });
    const keepaliveFailures = [];
    lease.on('keepaliveFailed', (err) => keepaliveFailures.push(describeError(err)));
    const id = await lease.grant();
    check(/^[0-9]+$/.test(id) && id !== '0', `lease id ${id}`);
    // The first keepalive goes out as soon as the stream is up, then one a second;
    // wait for two answers on the same stream.
    const [first] = await nextEvent(lease, 'keepaliveSucceeded', 8000, 'first keepalive');
    const [second] = await nextEvent(lease, 'keepaliveSucceeded', 8000, 'second keepalive');
    const k = `${RUN}/lease/k`;
    await lease.put(k).value('leased');
    const kv = (await client.get(k).exec()).kvs[0];
    const ttl = await client.leaseClient.leaseTimeToLive({ ID: id, keys: true });
    const once = await lease.keepaliveOnce();
    await lease.revoke();
    const after = await client.get(k).string();
    const ttlAfter = await client.leaseClient.leaseTimeToLive({ ID: id });
    check(lost === null, `lease lost: ${JSON.stringify(lost)}`);
    check(keepaliveFailures.length === 0, `keepalive failed: ${JSON.stringify(keepaliveFailures)}`);
    return {
      id_matches_kv: kv.lease === id,
      first_keepalive_id_matches: first.ID === id,
      first_keepalive_ttl: first.TTL,
      second_keepalive_ttl: second.TTL,
      keepalive_once_ttl: once.TTL,
      ttl_granted: ttl.grantedTTL,
      ttl_remaining_ok: Number(ttl.TTL) > 0 && Number(ttl.TTL) <= 3,
      ttl_keys: ttl.keys.map((b) => b.toString().slice(RUN.length)),
      revoked: lease.revoked(),
      value_after_revoke: after,
      ttl_after_revoke: ttlAfter.TTL,
    };
  },

  async watch(client) {
    const k = `${RUN}/watch/k`;
    const watcher = await withTimeout(
      client.watch().key(k).withPreviousKV().create(),
      8000,
      'watch create',
    );
    const events = [];
    let errored = null;
    watcher.on('put', (kv, prev) => events.push({ type: 'put', value: kv.value.toString(), prev: prev ? prev.value.toString() : null, mod: kv.mod_revision }));
    watcher.on('delete', (kv, prev) => events.push({ type: 'delete', value: kv.value.toString(), prev: prev ? prev.value.toString() : null, mod: kv.mod_revision }));
    watcher.on('error', (err) => {
      errored = describeError(err);
    });
    watcher.on('disconnected', (err) => {
      errored = { disconnected: describeError(err) };
    });
    // A key beside it must not show up.
    await client.put(`${k}2`).value('other');
    await client.put(k).value('a');
    await client.put(k).value('b');
    await client.delete().key(k);
    await waitFor(() => events.length >= 3 || errored !== null, 8000, `3 events (got ${JSON.stringify(events)})`);
    check(errored === null, `watcher error ${JSON.stringify(errored)}`);
    const mods = events.map((e) => BigInt(e.mod));
    const ordered = mods.every((m, i) => i === 0 || m > mods[i - 1]);
    // cancel() resolves once the server has answered the cancel_request.
    await withTimeout(watcher.cancel(), 8000, 'watcher cancel');
    // Nothing arrives after cancel.
    await client.put(k).value('after cancel');
    await new Promise((r) => setTimeout(r, 300));
    return {
      events: events.map(({ type, value, prev }) => ({ type, value, prev })),
      revisions_increase: ordered,
      events_after_cancel: events.length - 3,
    };
  },

  async watch_from_revision(client) {
    // A watch that starts in the past replays history.
    const k = `${RUN}/watchrev/k`;
    const r1 = await client.put(k).value('one');
    await client.put(k).value('two');
    // Listen before the watch is created: history may come with the first responses.
    const watcher = client.watch().key(k).startRevision(r1.header.revision).watcher();
    const seen = [];
    watcher.on('put', (kv) => seen.push(kv.value.toString()));
    await waitFor(() => seen.length >= 2, 8000, `2 replayed puts (got ${JSON.stringify(seen)})`);
    await withTimeout(watcher.cancel(), 8000, 'watcher cancel');
    return { replayed: seen };
  },

  async lock(client) {
    const name = `${RUN}/lock/l`;
    let inside = null;
    const value = await withTimeout(
      client
        .lock(name)
        .ttl(5)
        .do(async () => {
          const held = await client.get(name).exec();
          const contended = await expectError(client.lock(name).ttl(5).acquire(), 'second lock');
          contended.message = contended.message.replace(RUN, '<run>');
          inside = {
            key_held: held.kvs.length === 1,
            key_has_lease: held.kvs.length === 1 && held.kvs[0].lease !== '0',
            contended,
          };
          return 'done';
        }),
      STEP_TIMEOUT_MS,
      'lock do',
    );
    const after = await client.get(name).exists();
    // Once released it can be taken again.
    const again = await client.lock(name).ttl(5).acquire();
    await again.release();
    return { do_value: value, ...inside, held_after_release: after, reacquired: true };
  },

  async election(client) {
    const election = client.election(`${RUN}/election`, 5);
    const observer = await withTimeout(election.observe(), 8000, 'observe');
    const changes = [];
    observer.on('change', (v) => changes.push(v === undefined ? null : v));
    const c1 = election.campaign('candidate-1');
    await withTimeout(c1.wait(), 8000, 'candidate-1 elected');
    // Let the observer settle on candidate-1 first: the package's observer takes
    // the last put of a watch response as the leader, so a candidate-2 put
    // batched with candidate-1's would make it skip candidate-1.
    await waitFor(() => observer.leader() === 'candidate-1', 8000, 'observer sees candidate-1');
    const c2 = election.campaign('candidate-2');
    let c2elected = false;
    c2.on('elected', () => {
      c2elected = true;
    });
    await new Promise((r) => setTimeout(r, 300));
    const leaderWhileC1 = await election.leader();
    const c2EarlyElected = c2elected;
    await c1.proclaim('candidate-1b');
    const leaderAfterProclaim = await election.leader();
    await waitFor(() => observer.leader() === 'candidate-1b', 8000, 'observer sees candidate-1b');
    await c1.resign();
    await withTimeout(c2.wait(), 8000, 'candidate-2 elected after candidate-1 resigned');
    const leaderAfterResign = await election.leader();
    await c2.resign();
    await waitFor(() => changes[changes.length - 1] === null, 8000, 'observer sees no leader');
    const leaderAtEnd = await election.leader();
    await observer.cancel();
    return {
      leader_while_c1: leaderWhileC1,
      c2_elected_while_c1_led: c2EarlyElected,
      leader_after_proclaim: leaderAfterProclaim,
      leader_after_resign: leaderAfterResign,
      leader_at_end: leaderAtEnd === undefined ? null : leaderAtEnd,
      observed: changes,
    };
  },

  async namespace(client) {
    const ns = client.namespace(`${RUN}/ns/`);
    await ns.put('x').value('1');
    await ns.put('y').value('2');
    const inside = await ns.getAll().strings();
    const outside = await client.get(`${RUN}/ns/x`).string();
    await ns.delete().all();
    const left = await client.getAll().prefix(`${RUN}/ns/`).count();
    return { inside, outside, left_after_delete_all: left };
  },

  async errors(client) {
    // A put on a lease that was never granted.
    const badLease = await expectError(
      client.put(`${RUN}/err/k`).value('v').lease('123456789'),
      'put with an unknown lease',
    );
    const wrote = await client.get(`${RUN}/err/k`).exists();
    // A revoke of an unknown lease.
    const badRevoke = await expectError(
      client.leaseClient.leaseRevoke({ ID: '987654321' }),
      'revoke of an unknown lease',
    );
    // A get at a revision that was compacted away, and one in the future.
    const k = `${RUN}/err/compact`;
    const r1 = await client.put(k).value('old');
    const r2 = await client.put(k).value('new');
    await client.kv.compact({ revision: r2.header.revision, physical: true });
    const compacted = await expectError(client.get(k).revision(r1.header.revision).string(), 'get at a compacted revision');
    const atCompact = await client.get(k).revision(r2.header.revision).string();
    const future = await expectError(
      client.get(k).revision((BigInt(r2.header.revision) + 1000n).toString()).string(),
      'get at a future revision',
    );
    const compactAgain = await expectError(
      client.kv.compact({ revision: r1.header.revision }),
      'compact at an old revision',
    );
    return {
      bad_lease: badLease,
      bad_lease_wrote: wrote,
      bad_revoke: badRevoke,
      compacted,
      value_at_compact_revision: atCompact,
      future,
      compact_again: compactAgain,
    };
  },

  async watch_compacted(client) {
    // A watch from a compacted revision: the server creates it, then cancels it
    // with compact_revision set; the package reports that as an error event.
    const k = `${RUN}/watchcompact/k`;
    const r1 = await client.put(k).value('old');
    const r2 = await client.put(k).value('new');
    await client.kv.compact({ revision: r2.header.revision });
    const watcher = client.watch().key(k).startRevision(r1.header.revision).watcher();
    const [err] = await nextEvent(watcher, 'error', 8000, 'error event of a watch at a compacted revision');
    // The stream the watch shared goes on serving another watcher.
    const live = await withTimeout(client.watch().key(k).create(), 8000, 'a live watch beside it');
    const got = nextEvent(live, 'put', 8000, 'put on the live watch');
    await client.put(k).value('newer');
    const [kv] = await got;
    await withTimeout(live.cancel(), 8000, 'cancel of the live watch');
    return { error: describeError(err), live_value: kv.value.toString() };
  },
};

async function main() {
  const endpoint = process.argv[2];
  if (!endpoint || !/^[^:/]+:[0-9]+$/.test(endpoint)) {
    process.stderr.write('usage: node etcd3_suite.js HOST:PORT\n');
    process.exit(2);
  }
  const skip = new Set((process.env.SKIP_STEPS || '').split(',').filter(Boolean));
  const client = new Etcd3({
    hosts: `http://${endpoint}`,
    dialTimeout: 5000,
    // A deadline on every unary call; streams (watch, keepalive) live on.
    defaultCallOptions: (ctx) => (ctx.isStream ? {} : { deadline: Date.now() + CALL_DEADLINE_MS }),
    // No retries and no circuit breaker: a transport fault must fail its own
    // step, not be retried away or turn the later steps into "circuit open".
    faultHandling: { host: () => noop, global: noop },
  });
  const out = { ok: true, endpoint, results: {}, errors: {} };
  for (const [name, step] of Object.entries(steps)) {
    if (skip.has(name)) {
      continue;
    }
    try {
      out.results[name] = await withTimeout(step(client), STEP_TIMEOUT_MS, `step ${name}`);
    } catch (err) {
      out.ok = false;
      out.errors[name] = `${describeError(err).class}: ${describeError(err).message}`;
    }
  }
  client.close();
  process.stdout.write(`${JSON.stringify(out)}\n`);
  if (!out.ok) {
    for (const [name, msg] of Object.entries(out.errors)) {
      process.stderr.write(`step ${name} failed: ${msg}\n`);
    }
  }
  // Leftover timers (a lease the package still holds, a backoff) must not keep
  // the process alive once the results are out.
  process.exit(out.ok ? 0 : 1);
}

main().catch((err) => {
  process.stderr.write(`etcd3_suite: ${err && err.stack ? err.stack : err}\n`);
  process.exit(1);
});
