package main

// The phases every subcommand's run goes through, written once: the connections of each role,
// counting the measured phase's completions up to its end, stopping the producers and
// consumers, and the checks made once the run is over.

import (
	"context"
	"flag"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	pb "go.etcd.io/etcd/etcdserver/etcdserverpb"
	"google.golang.org/grpc"
)

// stopBound is how long producers and consumers may take to stop once their run has ended.
const stopBound = 10 * time.Second

// randomName is prefix and 8 random hex digits: a queue (or key prefix) no earlier run used.
func randomName(prefix string) string {
	return prefix + uuid.New().String()[:8]
}

// roles are a run's connections: the --endpoint ones (main), and the producers' and the
// consumers', dialled from --producer-endpoints and --consumer-endpoints, or else main.
type roles struct {
	main, producers, consumers []*grpc.ClientConn
	dialled                    [][]*grpc.ClientConn
}

// dialRoles dials every role of c; an error says which role it failed for. close ends them.
func dialRoles(ctx context.Context, c *common) (*roles, error) {
	main, err := dial(ctx, c.endpoint, c.conns)
	if err != nil {
		return nil, err
	}
	r := &roles{main: main, dialled: [][]*grpc.ClientConn{main}}
	for _, role := range []struct {
		name, list string
		into       *[]*grpc.ClientConn
	}{
		{"producers", c.producerEPs, &r.producers},
		{"consumers", c.consumerEPs, &r.consumers},
	} {
		conns, own, err := dialRole(ctx, role.list, c.conns, main)
		if err != nil {
			r.close()
			return nil, fmt.Errorf("%s: %w", role.name, err)
		}
		if own {
			r.dialled = append(r.dialled, conns)
		}
		*role.into = conns
	}
	return r, nil
}

func (r *roles) close() {
	for _, conns := range r.dialled {
		closeAll(conns)
	}
}

// completions counts what ends a message's way (an ack, a claim) in the measured phase, and
// when the last one came; `all` is closed once there are `total`.
type completions struct {
	start time.Time
	total int64
	n     atomic.Int64
	last  atomic.Int64 // ns since start
	all   chan struct{}
	once  sync.Once
}

func newCompletions(start time.Time, total int) *completions {
	return &completions{start: start, total: int64(total), all: make(chan struct{})}
}

// since is the ns from the start of the measured phase to now.
func (c *completions) since() int64 { return time.Since(c.start).Nanoseconds() }

// add counts k completions that came at `at` (ns since the start).
func (c *completions) add(k int64, at int64) {
	c.last.Store(at)
	if c.n.Add(k) >= c.total {
		c.once.Do(func() { close(c.all) })
	}
}

func (c *completions) count() int64 { return c.n.Load() }

// await ends the measured phase: when every completion is in, or (a failure) when `measure`
// ends first. It closes the window at the last completion, stops the progress lines and fills
// o's rate and CPU figures; `done` names a completion in the timeout's failure ("acknowledged").
func (c *completions) await(measure context.Context, o *output, w *window, stopProgress chan struct{}, timeout time.Duration, done string) {
	select {
	case <-c.all:
	case <-measure.Done():
		o.fail("timed out after %s with %d of %d %s", timeout, c.count(), c.total, done)
	}
	w.close(c.start.Add(time.Duration(c.last.Load())))
	close(stopProgress)
	o.finish(w, c.count())
}

// receiveEvents hands every watch response that has events to `handle` until the stream ends;
// an end the run did not cause is an RPC error, a cancel by the server goes to `canceled`.
func receiveEvents(run context.Context, stream pb.Watch_WatchClient, errs *errorLog, canceled func(reason string), handle func(*pb.WatchResponse)) {
	for {
		resp, err := stream.Recv()
		if err != nil {
			if !ended(run, err) {
				errs.add("consumer watch", err)
			}
			return
		}
		if resp.Canceled {
			canceled(resp.CancelReason)
			return
		}
		if len(resp.Events) == 0 {
			continue
		}
		handle(resp)
	}
}

// settleAndStop keeps the consumers running for `settle` (a late, second delivery or claim is
// counted as a duplicate), then stops the run and waits, bounded, for every group to end.
func settleAndStop(o *output, settle time.Duration, stop func(), groups ...*sync.WaitGroup) {
	time.Sleep(settle)
	stop()
	for _, g := range groups {
		if !waitGroupFor(g, stopBound) {
			o.fail("producers or consumers did not stop within %.0f s", stopBound.Seconds())
			return
		}
	}
}

// perConsumer records the fewest and the most completions of any one of n consumers.
func (o *output) perConsumer(n int, completed func(i int) int64) {
	least, most := int64(-1), int64(0)
	for i := 0; i < n; i++ {
		r := completed(i)
		if least < 0 || r < least {
			least = r
		}
		if r > most {
			most = r
		}
	}
	o.Counts["per_consumer_min"] = least
	o.Counts["per_consumer_max"] = most
}

// checkLeft counts (bounded by `timeout`) the keys a finished run left `where` ("in the
// queue"): any left fails the run, as "N `what` left `where` after every `after`".
func (o *output) checkLeft(timeout time.Duration, count func(context.Context) (int64, error), where, what, after string) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	left, err := count(ctx)
	if err != nil {
		o.fail("counting what is left %s: %v", where, err)
		return
	}
	o.Counts["left_in_queue"] = left
	if left != 0 {
		o.fail("%d %s left %s after every %s", left, what, where, after)
	}
}

// subcommand runs one subcommand once its flags are declared on fs: it parses them (exit
// status 2 on a usage error, `check` adding the subcommand's own rules), lets `start` fill what
// the flags left open and make the output, runs `run`, and prints the JSON object.
func subcommand(fs *flag.FlagSet, args []string, c *common, check func() error, start func() *output, run func(*output, *errorLog)) int {
	if !parseFlags(fs, args, c, check) {
		return 2
	}
	o := start()
	errs := &errorLog{}
	run(o, errs)
	return o.emit(errs)
}
