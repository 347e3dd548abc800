package main

// The Change Queue Service (dtoflow.changequeue.v1.DtoChangeQueueService, etcdserverpb/cqs.proto;
// docs/cqs.md). The stubs are generated at build time into the temporary GOPATH.
//
// cqs-dequeue: create the queue (subscribed to --dto-type), prefill --total notifications with
// distinct ids t/{tenant}/s/store{NN}/esls/{barcode} over --stores stores (etcd puts on
// /q/dto:{type}/p/{i}, --prefill-txn per Txn; or one ReEnqueue stream), then --consumers
// consumers loop BatchDequeue(--batch, --depth) + BatchAcknowledge until every one is
// acknowledged. Each id must be dequeued exactly once, and the queue must be empty at the end.
//
// cqs-reenqueue: create the queue, publish one seed notification, dequeue it, then one
// ReEnqueue stream (Header, --total items, Footer) that replaces it. The answer must count every
// item and acknowledge the seed, and the queue must then hold exactly --total notifications.

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	pb "go.etcd.io/etcd/etcdserver/etcdserverpb"
	"google.golang.org/grpc"

	cqspb "queuebench/cqspb"
)

const (
	cqsTenant      = "retail"
	cqsSLA         = "2026-01-01T10:00:01Z"
	cqsBarcodeBase = 2_000_000_000_000
)

type cqsFlags struct {
	common
	queue      string
	dtoType    string
	stores     int
	consumers  int
	batch      int
	depth      int
	waitMs     int
	prefill    string
	prefillTxn int
}

func addCQSFlags(fs *flag.FlagSet, f *cqsFlags, total int) {
	addCommon(fs, &f.common, total)
	fs.StringVar(&f.queue, "queue", "", "CQS queue name (default: bench-cqs-{random}, a new queue)")
	fs.StringVar(&f.dtoType, "dto-type", "esl", "dto_type of the notifications (the queue subscribes to it)")
	fs.IntVar(&f.stores, "stores", 50, "stores the ids are spread over (t/{tenant}/s/store{NN}/esls/{barcode})")
}

func (f *cqsFlags) id(i int) string {
	return fmt.Sprintf("t/%s/s/store%02d/esls/%013d", cqsTenant, i%f.stores, cqsBarcodeBase+i)
}

// seqOf is the item number of an id made by id(), or -1.
func seqOf(id string) int64 {
	at := strings.LastIndexByte(id, '/')
	n, err := strconv.ParseInt(id[at+1:], 10, 64)
	if at < 0 || err != nil || n < cqsBarcodeBase {
		return -1
	}
	return n - cqsBarcodeBase
}

func publication(id string) []byte {
	v, _ := json.Marshal(map[string]string{"dto_id": id, "sla_timestamp": cqsSLA})
	return v
}

// cqsCreate creates (or configures) the queue with one subscription.
func cqsCreate(ctx context.Context, conn *grpc.ClientConn, f *cqsFlags) error {
	cctx, cancel := context.WithTimeout(ctx, f.rpcTimeout)
	defer cancel()
	_, err := cqspb.NewDtoChangeQueueServiceClient(conn).CreateOrConfigureQueue(cctx, &cqspb.CreateOrConfigureQueueRequest{
		QueueName:     f.queue,
		Subscriptions: []*cqspb.DtoTypeSubscription{{DtoType: f.dtoType}},
		Depth:         int32(f.depth),
	})
	if err != nil {
		return fmt.Errorf("CreateOrConfigureQueue %s: %w", f.queue, err)
	}
	return nil
}

// cqsSeed publishes one notification (an etcd put on /q/dto:{type}/p/seed) and dequeues it:
// the ack token a ReEnqueue stream splits.
func cqsSeed(ctx context.Context, conn *grpc.ClientConn, f *cqsFlags) (string, error) {
	seed := "t/" + cqsTenant
	cctx, cancel := context.WithTimeout(ctx, f.rpcTimeout)
	defer cancel()
	if _, err := pb.NewKVClient(conn).Put(cctx, &pb.PutRequest{
		Key: []byte("/q/dto:" + f.dtoType + "/p/seed"), Value: publication(seed),
	}); err != nil {
		return "", fmt.Errorf("publishing the seed: %w", err)
	}
	resp, err := cqspb.NewDtoChangeQueueServiceClient(conn).BatchDequeue(cctx, &cqspb.BatchDequeueRequest{
		QueueName: f.queue, MaxNotifications: 1, WaitTimeMilliseconds: 5000,
	})
	if err != nil {
		return "", fmt.Errorf("dequeuing the seed: %w", err)
	}
	if len(resp.Notifications) != 1 || resp.Notifications[0].GetDtoId() != seed {
		return "", fmt.Errorf("the seed publication was not delivered: %v", resp.Notifications)
	}
	return resp.Notifications[0].AckToken, nil
}

// cqsReEnqueue sends one stream replacing `token` with items first..first+n-1; sent counts
// the items sent so far.
func cqsReEnqueue(ctx context.Context, conn *grpc.ClientConn, f *cqsFlags, token string, n int, sent *atomic.Int64) (*cqspb.ReEnqueueResponse, error) {
	stream, err := cqspb.NewDtoChangeQueueServiceClient(conn).ReEnqueue(ctx)
	if err != nil {
		return nil, err
	}
	if err := stream.Send(&cqspb.ReEnqueueRequest{Payload: &cqspb.ReEnqueueRequest_Header_{
		Header: &cqspb.ReEnqueueRequest_Header{QueueName: f.queue, AckToken: token},
	}}); err != nil {
		return nil, fmt.Errorf("sending the header: %w", err)
	}
	for i := 0; i < n; i++ {
		if err := stream.Send(&cqspb.ReEnqueueRequest{Payload: &cqspb.ReEnqueueRequest_Item{
			Item: &cqspb.SplitItem{DtoType: f.dtoType, Urn: &cqspb.SplitItem_DtoId{DtoId: f.id(i)}},
		}}); err != nil {
			// The server ended the stream; CloseAndRecv gives its status.
			_, rerr := stream.CloseAndRecv()
			return nil, fmt.Errorf("sending item %d: %v (stream status: %v)", i, err, rerr)
		}
		sent.Add(1)
	}
	if err := stream.Send(&cqspb.ReEnqueueRequest{Payload: &cqspb.ReEnqueueRequest_Footer_{
		Footer: &cqspb.ReEnqueueRequest_Footer{},
	}}); err != nil {
		_, rerr := stream.CloseAndRecv()
		return nil, fmt.Errorf("sending the footer: %v (stream status: %v)", err, rerr)
	}
	return stream.CloseAndRecv()
}

// cqsCount counts the queue's notifications (pending and in flight) with count-only Ranges
// over its message keys /q/{queue}/0... to /q/{queue}/: (the etcd view of a CQS queue on
// our server) and its rows /q/{queue}/n/... (a CQS queue over etcd, through fronts).
func cqsCount(ctx context.Context, conn *grpc.ClientConn, f *cqsFlags) (int64, error) {
	p := "/q/" + f.queue + "/"
	kv := pb.NewKVClient(conn)
	view, err := countKeys(ctx, kv, []byte(p+"0"), []byte(p+":"), f.rpcTimeout)
	if err != nil {
		return 0, err
	}
	rows, err := countKeys(ctx, kv, []byte(p+"n/"), []byte(p+"n0"), f.rpcTimeout)
	return view + rows, err
}

// cqsFilled waits, within ctx, until the queue holds `want` notifications: at once on our
// server, a moment after the puts through fronts over etcd, which fan publications out
// after they are stored.
func cqsFilled(ctx context.Context, conn *grpc.ClientConn, f *cqsFlags, want int64) (int64, error) {
	for {
		queued, err := cqsCount(ctx, conn, f)
		if err != nil || queued >= want || ctx.Err() != nil {
			return queued, err
		}
		select {
		case <-ctx.Done():
			return queued, nil
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func runCQSDequeue(args []string) int {
	var f cqsFlags
	fs := flag.NewFlagSet("cqs-dequeue", flag.ContinueOnError)
	addCQSFlags(fs, &f, 20000)
	fs.IntVar(&f.consumers, "consumers", 4, "consumers, each looping BatchDequeue + BatchAcknowledge")
	fs.IntVar(&f.batch, "batch", 20, "max_notifications of each BatchDequeue")
	fs.IntVar(&f.depth, "depth", 4, "prefix_depth of each BatchDequeue (and the queue's depth)")
	fs.IntVar(&f.waitMs, "wait-ms", 1000, "wait_time_milliseconds of each BatchDequeue")
	fs.StringVar(&f.prefill, "prefill", "put", "how the queue is filled: put (etcd puts on /q/dto:{type}/p/{i}, in Txns) or reenqueue (one ReEnqueue stream)")
	fs.IntVar(&f.prefillTxn, "prefill-txn", 128, "puts per Txn when --prefill=put (the server's --max-txn-ops is 128 by default)")
	return subcommand(fs, args, &f.common, func() error {
		switch {
		case f.consumers < 1 || f.batch < 1 || f.prefillTxn < 1 || f.stores < 1:
			return fmt.Errorf("--consumers, --batch, --prefill-txn and --stores must be at least 1")
		case f.prefill != "put" && f.prefill != "reenqueue":
			return fmt.Errorf("--prefill must be put or reenqueue")
		case f.waitMs < 0 || f.depth < 0:
			return fmt.Errorf("--wait-ms and --depth must not be negative")
		}
		return nil
	}, func() *output {
		if f.queue == "" {
			f.queue = randomName("bench-cqs-")
		}
		o := newOutput("cqs-dequeue", &f.common, "notification")
		o.Params = map[string]any{
			"queue": f.queue, "total": f.total, "consumers": f.consumers, "batch": f.batch,
			"depth": f.depth, "wait_ms": f.waitMs, "prefill": f.prefill, "stores": f.stores, "conns": f.conns,
		}
		o.LatencyOf = "one batch: BatchDequeue sent to BatchAcknowledge answered"
		return o
	}, func(o *output, errs *errorLog) { cqsDequeueRun(&f, o, errs) })
}

func cqsPrefill(ctx context.Context, conns []*grpc.ClientConn, f *cqsFlags) error {
	if f.prefill == "reenqueue" {
		token, err := cqsSeed(ctx, conns[0], f)
		if err != nil {
			return err
		}
		var sent atomic.Int64
		resp, err := cqsReEnqueue(ctx, conns[0], f, token, f.total, &sent)
		if err != nil {
			return fmt.Errorf("prefill ReEnqueue: %w", err)
		}
		if int(resp.ItemsEnqueued) != f.total {
			return fmt.Errorf("prefill ReEnqueue enqueued %d of %d", resp.ItemsEnqueued, f.total)
		}
		return nil
	}
	txns := (f.total + f.prefillTxn - 1) / f.prefillTxn
	var next atomic.Int64
	var wg sync.WaitGroup
	var mu sync.Mutex
	var firstErr error
	for g := 0; g < 4; g++ {
		kv := pb.NewKVClient(conns[g%len(conns)])
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				t := int(next.Add(1) - 1)
				if t >= txns {
					return
				}
				var ops []*pb.RequestOp
				for i := t * f.prefillTxn; i < (t+1)*f.prefillTxn && i < f.total; i++ {
					ops = append(ops, &pb.RequestOp{Request: &pb.RequestOp_RequestPut{RequestPut: &pb.PutRequest{
						Key: []byte(fmt.Sprintf("/q/dto:%s/p/%d", f.dtoType, i)), Value: publication(f.id(i)),
					}}})
				}
				cctx, cancel := context.WithTimeout(ctx, f.rpcTimeout)
				resp, err := kv.Txn(cctx, &pb.TxnRequest{Success: ops})
				cancel()
				if err == nil && !resp.Succeeded {
					err = fmt.Errorf("prefill Txn did not succeed")
				}
				if err != nil {
					mu.Lock()
					if firstErr == nil {
						firstErr = fmt.Errorf("prefill: %w", err)
					}
					mu.Unlock()
					return
				}
			}
		}()
	}
	wg.Wait()
	return firstErr
}

func cqsDequeueRun(f *cqsFlags, o *output, errs *errorLog) {
	base := context.Background()
	setup, cancelSetup := context.WithTimeout(base, f.setupTimeout)
	defer cancelSetup()
	conns, err := dial(setup, f.endpoint, f.conns)
	if err != nil {
		o.fail("%v", err)
		return
	}
	defer closeAll(conns)
	if err := cqsCreate(setup, conns[0], f); err != nil {
		o.fail("%v", err)
		return
	}
	t0 := time.Now()
	if err := cqsPrefill(setup, conns, f); err != nil {
		o.fail("%v", err)
		return
	}
	queued, err := cqsFilled(setup, conns[0], f, int64(f.total))
	if err != nil || queued != int64(f.total) {
		o.fail("after the prefill the queue holds %d notifications, not %d (error %v)", queued, f.total, err)
		return
	}
	prefillS := time.Since(t0).Seconds()
	o.Params["prefill_s"] = prefillS
	logf("cqs-dequeue: %d notifications queued in %s by %s (%.1f s); %d consumers dequeue", f.total, f.queue, f.prefill, prefillS, f.consumers)

	tr := newTracker(f.total)
	for i := 0; i < f.total; i++ {
		tr.markProduced(i)
	}
	var batches, empty atomic.Int64
	measure, stopMeasure := context.WithTimeout(base, f.timeout)
	defer stopMeasure()
	var latMu sync.Mutex
	var batchLat []int64

	var w window
	w.open(f.serverPids)
	acked := newCompletions(w.t0, f.total)
	var wg sync.WaitGroup
	for c := 0; c < f.consumers; c++ {
		cli := cqspb.NewDtoChangeQueueServiceClient(conns[c%len(conns)])
		wg.Add(1)
		go func() {
			defer wg.Done()
			var lat []int64
			defer func() {
				latMu.Lock()
				batchLat = append(batchLat, lat...)
				latMu.Unlock()
			}()
			req := &cqspb.BatchDequeueRequest{
				QueueName: f.queue, MaxNotifications: int32(f.batch), PrefixDepth: int32(f.depth),
				WaitTimeMilliseconds: int32(f.waitMs),
			}
			for measure.Err() == nil && acked.count() < int64(f.total) {
				b0 := time.Now()
				cctx, cancel := context.WithTimeout(measure, f.rpcTimeout+time.Duration(f.waitMs)*time.Millisecond)
				resp, err := cli.BatchDequeue(cctx, req)
				cancel()
				if err != nil {
					if measure.Err() == nil && acked.count() < int64(f.total) {
						errs.add("BatchDequeue", err)
					}
					continue
				}
				if len(resp.Notifications) == 0 {
					empty.Add(1)
					continue
				}
				tokens := make([]string, len(resp.Notifications))
				for i, n := range resp.Notifications {
					tokens[i] = n.AckToken
					if s := seqOf(n.GetDtoId()); s >= 0 {
						tr.receive(uint64(s), 0)
					} else {
						tr.unknown.Add(1)
					}
				}
				cctx, cancel = context.WithTimeout(measure, f.rpcTimeout)
				_, err = cli.BatchAcknowledge(cctx, &cqspb.BatchAcknowledgeRequest{QueueName: f.queue, AckTokens: tokens})
				cancel()
				if err != nil {
					errs.add("BatchAcknowledge", err)
					continue
				}
				lat = append(lat, time.Since(b0).Nanoseconds())
				batches.Add(1)
				acked.add(int64(len(tokens)), acked.since())
			}
		}()
	}
	stopProgress := make(chan struct{})
	progress(f.progress, stopProgress, func() string {
		a := acked.count()
		return fmt.Sprintf("cqs-dequeue: %d of %d acknowledged, %.0f/s so far", a, f.total, float64(a)/time.Since(w.t0).Seconds())
	})
	acked.await(measure, o, &w, stopProgress, f.timeout, "acknowledged")
	stopMeasure() // ends the consumers' long polls
	if !waitGroupFor(&wg, stopBound) {
		o.fail("consumers did not stop within %.0f s", stopBound.Seconds())
	}
	tr.check(o, "dequeued")
	o.LatencyMs = percentiles(batchLat)
	o.Counts["acknowledged"] = acked.count()
	o.Counts["batches"] = batches.Load()
	o.Counts["empty_dequeues"] = empty.Load()
	o.checkLeft(f.setupTimeout, func(ctx context.Context) (int64, error) {
		return cqsCount(ctx, conns[0], f)
	}, "in the queue", "notification(s)", "ack")
	logf("cqs-dequeue: %d acknowledged in %.2f s: %.0f notifications/s in %d batches", o.Count, o.Seconds, o.PerSecond, batches.Load())
}

func runCQSReEnqueue(args []string) int {
	var f cqsFlags
	fs := flag.NewFlagSet("cqs-reenqueue", flag.ContinueOnError)
	addCQSFlags(fs, &f, 100000)
	fs.IntVar(&f.depth, "depth", 4, "the queue's prefix depth")
	return subcommand(fs, args, &f.common, func() error {
		if f.stores < 1 {
			return fmt.Errorf("--stores must be at least 1")
		}
		return nil
	}, func() *output {
		if f.queue == "" {
			f.queue = randomName("bench-cqs-")
		}
		o := newOutput("cqs-reenqueue", &f.common, "item")
		o.Params = map[string]any{"queue": f.queue, "total": f.total, "stores": f.stores}
		return o
	}, func(o *output, errs *errorLog) { cqsReEnqueueRun(&f, o, errs) })
}

func cqsReEnqueueRun(f *cqsFlags, o *output, errs *errorLog) {
	base := context.Background()
	setup, cancelSetup := context.WithTimeout(base, f.setupTimeout)
	defer cancelSetup()
	conns, err := dial(setup, f.endpoint, 1)
	if err != nil {
		o.fail("%v", err)
		return
	}
	defer closeAll(conns)
	if err := cqsCreate(setup, conns[0], f); err != nil {
		o.fail("%v", err)
		return
	}
	token, err := cqsSeed(setup, conns[0], f)
	if err != nil {
		o.fail("%v", err)
		return
	}
	logf("cqs-reenqueue: one stream of %d items splitting the seed of %s", f.total, f.queue)
	measure, stopMeasure := context.WithTimeout(base, f.timeout)
	defer stopMeasure()
	var sent atomic.Int64
	var w window
	w.open(f.serverPids)
	stopProgress := make(chan struct{})
	progress(f.progress, stopProgress, func() string {
		s := sent.Load()
		return fmt.Sprintf("cqs-reenqueue: %d of %d items sent, %.0f/s so far", s, f.total, float64(s)/time.Since(w.t0).Seconds())
	})
	resp, err := cqsReEnqueue(measure, conns[0], f, token, f.total, &sent)
	w.close(time.Now())
	close(stopProgress)
	var enqueued int64
	if err != nil {
		errs.add("ReEnqueue", err)
	} else {
		enqueued = int64(resp.ItemsEnqueued)
		if enqueued != int64(f.total) {
			o.fail("sent %d items, the server enqueued %d", f.total, enqueued)
		}
		if !resp.Acknowledged {
			o.fail("the stream did not acknowledge the original notification")
		}
	}
	o.finish(&w, enqueued)
	o.Counts["sent"] = sent.Load()
	o.Counts["items_enqueued"] = enqueued
	check, cancelCheck := context.WithTimeout(base, f.setupTimeout)
	defer cancelCheck()
	queued, err := cqsCount(check, conns[0], f)
	if err != nil {
		o.fail("counting the queue: %v", err)
	} else {
		o.Counts["queued_after"] = queued
		if queued != int64(f.total) {
			o.fail("the queue holds %d notifications after the stream, not %d", queued, f.total)
		}
	}
	logf("cqs-reenqueue: %d items in %.2f s: %.0f items/s", enqueued, o.Seconds, o.PerSecond)
}
