package main

// etcd's queue recipe, the way etcd users build a work queue on plain etcd: producers put
// messages under a prefix (one key per message); every consumer prefix-watches it and claims
// the oldest message it knows of with a Txn that compares the key's mod_revision with the one
// in the event and deletes the key. Every consumer sees every message, so with several
// consumers many claims lose the race: those are counted as claim conflicts. A message is
// claimed when the Txn succeeded; each must be claimed exactly once.

import (
	"container/heap"
	"context"
	"flag"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	pb "go.etcd.io/etcd/etcdserver/etcdserverpb"
	"go.etcd.io/etcd/mvcc/mvccpb"
	"google.golang.org/grpc"
)

type recipeFlags struct {
	common
	prefix    string
	consumers int
	producers int
	inflight  int
	settle    time.Duration
}

type pendingMsg struct {
	rev   int64
	key   string
	stamp int64
	seq   uint64
}

// revHeap orders a consumer's known messages oldest (lowest mod_revision) first.
type revHeap []pendingMsg

func (h revHeap) Len() int           { return len(h) }
func (h revHeap) Less(i, j int) bool { return h[i].rev < h[j].rev }
func (h revHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *revHeap) Push(x any)        { *h = append(*h, x.(pendingMsg)) }
func (h *revHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

type recipeConsumer struct {
	conn    *grpc.ClientConn
	stream  pb.Watch_WatchClient
	mu      sync.Mutex
	pending map[string]int64 // key -> mod_revision of the PUT seen, until its DELETE
	order   revHeap
	wake    chan struct{}
	claimed atomic.Int64
}

func (c *recipeConsumer) signal() {
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// next takes the oldest message this consumer knows to be unclaimed.
func (c *recipeConsumer) next() (pendingMsg, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for c.order.Len() > 0 {
		m := heap.Pop(&c.order).(pendingMsg)
		if rev, ok := c.pending[m.key]; ok && rev == m.rev {
			delete(c.pending, m.key)
			return m, true
		}
	}
	return pendingMsg{}, false
}

func runRecipe(args []string) int {
	var f recipeFlags
	fs := flag.NewFlagSet("recipe", flag.ContinueOnError)
	addCommon(fs, &f.common, 5000)
	fs.StringVar(&f.prefix, "prefix", "", "key prefix of the queue (default: /bench/recipe/{random}/)")
	fs.IntVar(&f.consumers, "consumers", 8, "consumers, each a prefix watch on its own Watch stream and one claim in flight")
	fs.IntVar(&f.producers, "producers", 4, "producer goroutines, each with one Put in flight")
	fs.IntVar(&f.inflight, "inflight", 128, "most messages produced and not yet claimed")
	fs.DurationVar(&f.settle, "settle", 300*time.Millisecond, "after the last claim, keep the consumers running this long (a late second claim is a failure)")
	return subcommand(fs, args, &f.common, func() error {
		if f.consumers < 1 || f.producers < 1 || f.inflight < 1 {
			return fmt.Errorf("--consumers, --producers and --inflight must be at least 1")
		}
		return nil
	}, func() *output {
		if f.prefix == "" {
			f.prefix = randomName("/bench/recipe/") + "/"
		}
		o := newOutput("recipe", &f.common, "msg")
		o.Params = map[string]any{
			"prefix": f.prefix, "total": f.total, "consumers": f.consumers, "producers": f.producers,
			"inflight": f.inflight, "conns": f.conns, "value_size": f.valueSize,
		}
		o.LatencyOf = "produce (before the Put is sent) to a successful claim (the Txn answered)"
		return o
	}, func(o *output, errs *errorLog) { recipeRun(&f, o, errs) })
}

func recipeRun(f *recipeFlags, o *output, errs *errorLog) {
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
	prefix := []byte(f.prefix)
	end := prefixEnd(prefix)
	if n, err := countKeys(setup, kv, prefix, end, f.rpcTimeout); err != nil || n != 0 {
		o.fail("prefix %q must be empty at the start (count %d, error %v)", f.prefix, n, err)
		return
	}

	run, stopRun := context.WithCancel(base)
	defer stopRun()
	consumers := make([]*recipeConsumer, f.consumers)
	for i := range consumers {
		c := &recipeConsumer{conn: conns.consumers[i%len(conns.consumers)], pending: map[string]int64{}, wake: make(chan struct{}, 1)}
		c.stream, err = openWatch(run, c.conn, &pb.WatchCreateRequest{Key: prefix, RangeEnd: end}, f.setupTimeout)
		if err != nil {
			o.fail("consumer %d: %v", i, err)
			return
		}
		consumers[i] = c
	}
	logf("recipe: %d consumers watching %s; producing %d messages", len(consumers), f.prefix, f.total)

	tr := newTracker(f.total)
	sem := newSemaphore(f.inflight)
	var conflicts, claimTxns, events atomic.Int64
	measure, stopMeasure := context.WithTimeout(run, f.timeout)
	defer stopMeasure()

	var w window
	w.open(f.serverPids)
	claimed := newCompletions(w.t0, f.total)

	var receivers, workers sync.WaitGroup
	for _, c := range consumers {
		c := c
		receivers.Add(1)
		go func() {
			defer receivers.Done()
			defer c.signal()
			canceled := func(reason string) {
				errs.add("consumer watch", fmt.Errorf("canceled by the server: %s", reason))
			}
			receiveEvents(run, c.stream, errs, canceled, func(resp *pb.WatchResponse) {
				events.Add(int64(len(resp.Events)))
				c.mu.Lock()
				for _, ev := range resp.Events {
					key := string(ev.Kv.Key)
					if ev.Type == mvccpb.DELETE {
						delete(c.pending, key)
						continue
					}
					stamp, seq, ok := parseValue(ev.Kv.Value)
					if !ok {
						tr.unknown.Add(1)
						continue
					}
					c.pending[key] = ev.Kv.ModRevision
					heap.Push(&c.order, pendingMsg{rev: ev.Kv.ModRevision, key: key, stamp: stamp, seq: seq})
				}
				c.mu.Unlock()
				c.signal()
			})
		}()
		workers.Add(1)
		go func() {
			defer workers.Done()
			ckv := pb.NewKVClient(c.conn)
			for {
				m, ok := c.next()
				if !ok {
					select {
					case <-c.wake:
						continue
					case <-run.Done():
						return
					}
				}
				cctx, cancel := context.WithTimeout(run, f.rpcTimeout)
				resp, err := ckv.Txn(cctx, &pb.TxnRequest{
					Compare: []*pb.Compare{{
						Key: []byte(m.key), Target: pb.Compare_MOD, Result: pb.Compare_EQUAL,
						TargetUnion: &pb.Compare_ModRevision{ModRevision: m.rev},
					}},
					Success: []*pb.RequestOp{{Request: &pb.RequestOp_RequestDeleteRange{
						RequestDeleteRange: &pb.DeleteRangeRequest{Key: []byte(m.key)},
					}}},
				})
				cancel()
				if err != nil {
					if run.Err() == nil {
						errs.add("claim", err)
					}
					continue
				}
				claimTxns.Add(1)
				if !resp.Succeeded {
					conflicts.Add(1)
					continue
				}
				now := claimed.since()
				tr.receive(m.seq, now-m.stamp)
				c.claimed.Add(1)
				sem.release(1)
				claimed.add(1, now)
			}
		}()
	}

	var next atomic.Int64
	for p := 0; p < f.producers; p++ {
		pkv := pb.NewKVClient(conns.producers[p%len(conns.producers)])
		workers.Add(1)
		go func() {
			defer workers.Done()
			for {
				seq := int(next.Add(1) - 1)
				if seq >= f.total {
					return
				}
				if !sem.acquire(measure, 1) {
					return
				}
				cctx, cancel := context.WithTimeout(measure, f.rpcTimeout)
				_, err := pkv.Put(cctx, &pb.PutRequest{
					Key:   []byte(fmt.Sprintf("%s%012d", f.prefix, seq)),
					Value: value(f.valueSize, claimed.since(), seq),
				})
				cancel()
				if err != nil {
					if measure.Err() == nil {
						errs.add("produce", err)
					}
					continue
				}
				tr.markProduced(seq)
			}
		}()
	}

	stopProgress := make(chan struct{})
	progress(f.progress, stopProgress, func() string {
		c := claimed.count()
		return fmt.Sprintf("recipe: %d of %d claimed, %d conflicts, %.0f msgs/s so far",
			c, f.total, conflicts.Load(), float64(c)/time.Since(w.t0).Seconds())
	})
	claimed.await(measure, o, &w, stopProgress, f.timeout, "claimed")

	settleAndStop(o, f.settle, func() { stopMeasure(); stopRun() }, &workers, &receivers)

	tr.check(o, "claimed")
	o.Counts["claimed"] = claimed.count()
	o.Counts["claim_txns"] = claimTxns.Load()
	o.Counts["claim_conflicts"] = conflicts.Load()
	o.Counts["watch_events"] = events.Load()
	o.perConsumer(len(consumers), func(i int) int64 { return consumers[i].claimed.Load() })

	o.checkLeft(f.setupTimeout, func(ctx context.Context) (int64, error) {
		return countKeys(ctx, kv, prefix, end, f.rpcTimeout)
	}, "under the prefix", "key(s)", "claim")
	logf("recipe: %d claimed in %.2f s: %.0f msgs/s, %d conflicts", o.Count, o.Seconds, o.PerSecond, conflicts.Load())
}
