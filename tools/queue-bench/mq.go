package main

// The etcd-key queue of queue-server (docs/queue.md): each consumer watches the exact key
// /q/{name}/c/{uuid} on a Watch stream of its own and receives deliveries as PUT events of
// message keys /q/{name}/{idx}/{key} (or handed-over keys /q/{name}/c/{uuid}/{idx}/{key} on
// a member that does not dispatch the queue); it acknowledges by deleting the delivered key,
// one DeleteRange per message or up to --ack-batch DeleteRanges in one Txn. Producers put
// /q/{name}/p/m{seq} (one Put, or --put-batch puts in one Txn), at most --inflight messages
// produced and not yet acknowledged.

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	pb "go.etcd.io/etcd/etcdserver/etcdserverpb"
	"go.etcd.io/etcd/mvcc/mvccpb"
	"google.golang.org/grpc"
)

type mqFlags struct {
	common
	queue        string
	consumers    int
	producers    int
	putBatch     int
	ackBatch     int
	acksInFlight int
	ackLinger    time.Duration
	inflight     int
	prefetch     int
	settle       time.Duration
}

type mqConsumer struct {
	id        string
	key       []byte
	conn      *grpc.ClientConn
	stream    pb.Watch_WatchClient
	acks      chan []byte
	received  atomic.Int64
	canceled  atomic.Bool
	cancelWhy atomic.Value
}

func runMQ(args []string) int {
	var f mqFlags
	fs := flag.NewFlagSet("mq", flag.ContinueOnError)
	addCommon(fs, &f.common, 20000)
	fs.StringVar(&f.queue, "queue", "", "queue name (default: bench-{random}, a new queue)")
	fs.IntVar(&f.consumers, "consumers", 8, "consumers, each a watch on its own Watch stream")
	fs.IntVar(&f.producers, "producers", 8, "producer goroutines, each with one Put (or Txn) in flight")
	fs.IntVar(&f.putBatch, "put-batch", 1, "producer puts per request: 1 = Put, more = one Txn of that many puts")
	fs.IntVar(&f.ackBatch, "ack-batch", 1, "acks per request: 1 = DeleteRange, more = one Txn of up to that many deletes")
	fs.IntVar(&f.acksInFlight, "acks-in-flight", 4, "ack requests in flight per consumer")
	fs.DurationVar(&f.ackLinger, "ack-linger", 0, "with --ack-batch > 1, wait up to this long for a full batch of deliveries before acking fewer (0: ack what has arrived)")
	fs.IntVar(&f.inflight, "inflight", 128, "most messages produced and not yet acknowledged")
	fs.IntVar(&f.prefetch, "prefetch", 0, "put {\"prefetch\": N} on /q/{name}/config first (0: the queue's default, 64)")
	fs.DurationVar(&f.settle, "settle", 500*time.Millisecond, "after the last ack, keep watching this long for late (duplicate) deliveries")
	return subcommand(fs, args, &f.common, func() error {
		switch {
		case f.consumers < 1 || f.producers < 1 || f.acksInFlight < 1:
			return fmt.Errorf("--consumers, --producers and --acks-in-flight must be at least 1")
		case f.putBatch < 1 || f.ackBatch < 1:
			return fmt.Errorf("--put-batch and --ack-batch must be at least 1")
		case f.inflight < f.putBatch:
			return fmt.Errorf("--inflight must be at least --put-batch")
		case f.prefetch < 0:
			return fmt.Errorf("--prefetch must not be negative")
		}
		return nil
	}, func() *output {
		if f.queue == "" {
			f.queue = randomName("bench-")
		}
		o := newOutput("mq", &f.common, "msg")
		o.Params = map[string]any{
			"queue": f.queue, "total": f.total, "consumers": f.consumers, "producers": f.producers,
			"put_batch": f.putBatch, "ack_batch": f.ackBatch, "acks_in_flight": f.acksInFlight,
			"inflight": f.inflight, "prefetch": f.prefetch, "conns": f.conns, "value_size": f.valueSize,
			"ack_linger_ms": f.ackLinger.Seconds() * 1000,
		}
		o.LatencyOf = "produce (before the Put/Txn is sent) to delivery (the watch event received)"
		return o
	}, func(o *output, errs *errorLog) { mqRun(&f, o, errs) })
}

func mqRun(f *mqFlags, o *output, errs *errorLog) {
	base := context.Background()
	setup, cancelSetup := context.WithTimeout(base, f.setupTimeout)
	defer cancelSetup()
	conns, err := dialRoles(setup, &f.common)
	if err != nil {
		o.fail("%v", err)
		return
	}
	defer conns.close()
	kv := pb.NewKVClient(conns.main[0])
	prefix := "/q/" + f.queue + "/"

	if f.prefetch > 0 {
		cfg, _ := json.Marshal(map[string]int{"prefetch": f.prefetch})
		if _, err := kv.Put(setup, &pb.PutRequest{Key: []byte(prefix + "config"), Value: cfg}); err != nil {
			o.fail("put %sconfig: %v", prefix, err)
			return
		}
	}

	// Consumers: one Watch stream each (the run context ends them), then wait until the
	// server has registered every one (its registry key /q/{name}/c/{uuid} exists), so the
	// first messages are spread over all of them.
	run, stopRun := context.WithCancel(base)
	defer stopRun()
	consumers := make([]*mqConsumer, f.consumers)
	for i := range consumers {
		id := uuid.New().String()
		c := &mqConsumer{id: id, key: []byte(prefix + "c/" + id), conn: conns.consumers[i%len(conns.consumers)],
			acks: make(chan []byte, 1<<16)}
		c.stream, err = openWatch(run, c.conn, &pb.WatchCreateRequest{Key: c.key}, f.setupTimeout)
		if err != nil {
			o.fail("consumer %d: %v", i, err)
			return
		}
		consumers[i] = c
	}
	for i, c := range consumers {
		for {
			n, err := countKeys(setup, kv, c.key, nil, f.rpcTimeout)
			if err != nil {
				o.fail("consumer %d: reading its registry key: %v", i, err)
				return
			}
			if n > 0 {
				break
			}
			select {
			case <-setup.Done():
				o.fail("consumer %d (%s) not registered by the server within %s", i, c.key, f.setupTimeout)
				return
			case <-time.After(5 * time.Millisecond):
			}
		}
	}
	logf("mq: %d consumers registered on %s; producing %d messages (put batch %d, ack batch %d)",
		len(consumers), prefix, f.total, f.putBatch, f.ackBatch)

	tr := newTracker(f.total)
	sem := newSemaphore(f.inflight)
	var deliveries, responses, ackRequests, deletedNothing, produceRequests atomic.Int64
	measure, stopMeasure := context.WithTimeout(run, f.timeout)
	defer stopMeasure()

	var w window
	w.open(f.serverPids)
	acked := newCompletions(w.t0, f.total)

	var receivers, workers sync.WaitGroup
	for _, c := range consumers {
		c := c
		receivers.Add(1)
		go func() {
			defer receivers.Done()
			canceled := func(reason string) {
				c.canceled.Store(true)
				c.cancelWhy.Store(reason)
			}
			receiveEvents(run, c.stream, errs, canceled, func(resp *pb.WatchResponse) {
				now := acked.since()
				responses.Add(1)
				for _, ev := range resp.Events {
					if ev.Kv == nil {
						errs.add("consumer watch", fmt.Errorf("a %s event without a key", ev.Type))
						continue
					}
					if ev.Type != mvccpb.PUT {
						errs.add("consumer watch", fmt.Errorf("unexpected %s event on %q", ev.Type, ev.Kv.Key))
						continue
					}
					deliveries.Add(1)
					stamp, seq, ok := parseValue(ev.Kv.Value)
					if !ok {
						tr.unknown.Add(1)
						continue
					}
					tr.receive(seq, now-stamp)
					c.received.Add(1)
					c.acks <- ev.Kv.Key
				}
			})
		}()
		for a := 0; a < f.acksInFlight; a++ {
			workers.Add(1)
			go func() {
				defer workers.Done()
				for {
					var key []byte
					select {
					case key = <-c.acks:
					case <-measure.Done():
						return
					}
					batch := [][]byte{key}
					var linger <-chan time.Time
					if f.ackLinger > 0 && f.ackBatch > 1 {
						linger = time.After(f.ackLinger)
					}
				fill:
					for len(batch) < f.ackBatch {
						if linger == nil {
							select {
							case k := <-c.acks:
								batch = append(batch, k)
							default:
								break fill
							}
							continue
						}
						select {
						case k := <-c.acks:
							batch = append(batch, k)
						case <-linger:
							break fill
						case <-measure.Done():
							break fill
						}
					}
					deleted, err := mqAck(measure, pb.NewKVClient(c.conn), batch, f.rpcTimeout)
					if err != nil {
						if measure.Err() == nil {
							errs.add("ack", err)
						}
						continue
					}
					ackRequests.Add(1)
					if deleted < int64(len(batch)) {
						deletedNothing.Add(int64(len(batch)) - deleted)
					}
					if deleted > 0 {
						sem.release(int(deleted))
						acked.add(deleted, acked.since())
					}
				}
			}()
		}
	}

	var nextBatch atomic.Int64
	for p := 0; p < f.producers; p++ {
		pkv := pb.NewKVClient(conns.producers[p%len(conns.producers)])
		workers.Add(1)
		go func() {
			defer workers.Done()
			for {
				first := int(nextBatch.Add(1)-1) * f.putBatch
				if first >= f.total {
					return
				}
				n := f.putBatch
				if first+n > f.total {
					n = f.total - first
				}
				if !sem.acquire(measure, n) {
					return
				}
				stamp := acked.since()
				ops := make([]*pb.RequestOp, n)
				for i := 0; i < n; i++ {
					ops[i] = &pb.RequestOp{Request: &pb.RequestOp_RequestPut{RequestPut: &pb.PutRequest{
						Key:   []byte(fmt.Sprintf("%sp/m%012d", prefix, first+i)),
						Value: value(f.valueSize, stamp, first+i),
					}}}
				}
				cctx, cancel := context.WithTimeout(measure, f.rpcTimeout)
				var err error
				if n == 1 && f.putBatch == 1 {
					_, err = pkv.Put(cctx, ops[0].GetRequestPut())
				} else {
					var resp *pb.TxnResponse
					resp, err = pkv.Txn(cctx, &pb.TxnRequest{Success: ops})
					if err == nil && !resp.Succeeded {
						err = fmt.Errorf("produce Txn did not succeed")
					}
				}
				cancel()
				if err != nil {
					if measure.Err() == nil {
						errs.add("produce", err)
					}
					continue
				}
				produceRequests.Add(1)
				for i := 0; i < n; i++ {
					tr.markProduced(first + i)
				}
			}
		}()
	}

	stopProgress := make(chan struct{})
	progress(f.progress, stopProgress, func() string {
		a := acked.count()
		return fmt.Sprintf("mq: %d of %d acked, %d delivered, %.0f msgs/s so far",
			a, f.total, deliveries.Load(), float64(a)/time.Since(w.t0).Seconds())
	})
	acked.await(measure, o, &w, stopProgress, f.timeout, "acknowledged")

	// Late deliveries during the settle time count as duplicates; then stop everything.
	settleAndStop(o, f.settle, func() { stopMeasure(); stopRun() }, &workers, &receivers)

	tr.check(o, "delivered")
	o.Counts["acked"] = acked.count()
	o.Counts["deliveries"] = deliveries.Load()
	o.Counts["delivery_responses"] = responses.Load()
	o.Counts["ack_requests"] = ackRequests.Load()
	o.Counts["produce_requests"] = produceRequests.Load()
	o.Counts["acks_deleting_nothing"] = deletedNothing.Load()
	if deletedNothing.Load() > 0 {
		o.fail("%d ack(s) deleted nothing", deletedNothing.Load())
	}
	canceled := int64(0)
	for _, c := range consumers {
		if c.canceled.Load() {
			canceled++
			why, _ := c.cancelWhy.Load().(string)
			o.fail("the server canceled consumer %s's watch: %q", c.id, why)
		}
	}
	o.perConsumer(len(consumers), func(i int) int64 { return consumers[i].received.Load() })
	o.Counts["consumers_canceled"] = canceled

	// Nothing may be left: the message keys of the queue are /q/{name}/0... to /q/{name}/: .
	o.checkLeft(f.setupTimeout, func(ctx context.Context) (int64, error) {
		return countKeys(ctx, kv, []byte(prefix+"0"), []byte(prefix+":"), f.rpcTimeout)
	}, "in the queue", "message key(s)", "ack")
	logf("mq: %d acked in %.2f s: %.0f msgs/s", o.Count, o.Seconds, o.PerSecond)
}

// mqAck deletes the delivered keys: one DeleteRange, or one Txn of DeleteRanges.
func mqAck(ctx context.Context, kv pb.KVClient, keys [][]byte, timeout time.Duration) (int64, error) {
	cctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if len(keys) == 1 {
		resp, err := kv.DeleteRange(cctx, &pb.DeleteRangeRequest{Key: keys[0]})
		if err != nil {
			return 0, err
		}
		return resp.Deleted, nil
	}
	ops := make([]*pb.RequestOp, len(keys))
	for i, k := range keys {
		ops[i] = &pb.RequestOp{Request: &pb.RequestOp_RequestDeleteRange{RequestDeleteRange: &pb.DeleteRangeRequest{Key: k}}}
	}
	resp, err := kv.Txn(cctx, &pb.TxnRequest{Success: ops})
	if err != nil {
		return 0, err
	}
	var deleted int64
	for _, r := range resp.Responses {
		deleted += r.GetResponseDeleteRange().GetDeleted()
	}
	return deleted, nil
}
