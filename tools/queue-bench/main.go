// queue-bench: a load generator for the queue workloads of queue-server, in Go so that the
// client costs far less CPU per message than the server under test (Python gRPC clients
// saturate a small machine and flatter the server).
//
// Subcommands (each prints one JSON object on stdout, progress on stderr):
//
//	mq             the etcd-key queue: watch /q/{name}/c/{uuid}, put /q/{name}/p/{key}, delete to ack
//	recipe         etcd's queue recipe: put under a prefix, prefix watches, claim by Txn (mod_revision)
//	cqs-dequeue    CQS BatchDequeue + BatchAcknowledge from a prefilled queue
//	cqs-reenqueue  CQS ReEnqueue: one client stream of items splitting one in-flight notification
//
// Every message is tracked by number: the run fails (exit status 1, "ok": false) when one is
// missing, received twice, or unknown, or when any RPC fails.
//
// Build offline with scripts/build_queue_bench.sh (GOPATH mode, Debian's Go sources; the CQS
// stubs are generated from etcdserverpb/cqs.proto at build time).
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime/pprof"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	pb "go.etcd.io/etcd/etcdserver/etcdserverpb"
	"google.golang.org/grpc"
)

const usage = `usage: queue-bench SUBCOMMAND [flags]

subcommands:
  mq             etcd-key queue of queue-server (watch /q/{name}/c/{uuid}, put /q/{name}/p/{key}, delete = ack)
  recipe         etcd's queue recipe (prefix put, prefix watches, claim with a mod_revision Txn)
  cqs-dequeue    CQS BatchDequeue + BatchAcknowledge from a prefilled queue
  cqs-reenqueue  CQS ReEnqueue, one client stream

Run "queue-bench SUBCOMMAND -h" for the flags of one.
`

func main() {
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	var run func([]string) int
	switch os.Args[1] {
	case "mq":
		run = runMQ
	case "recipe":
		run = runRecipe
	case "cqs-dequeue":
		run = runCQSDequeue
	case "cqs-reenqueue":
		run = runCQSReEnqueue
	case "-h", "--help", "help":
		fmt.Fprint(os.Stdout, usage)
		os.Exit(0)
	default:
		fmt.Fprintf(os.Stderr, "unknown subcommand %q\n%s", os.Args[1], usage)
		os.Exit(2)
	}
	os.Exit(run(os.Args[2:]))
}

// startProfile starts the driver's CPU profile if asked; the returned func stops it.
func startProfile(path string) func() {
	if path == "" {
		return func() {}
	}
	f, err := os.Create(path)
	if err != nil {
		logf("cpuprofile: %v", err)
		return func() {}
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		logf("cpuprofile: %v", err)
		_ = f.Close()
		return func() {}
	}
	return func() {
		pprof.StopCPUProfile()
		_ = f.Close()
	}
}

// --- flags shared by every subcommand ---------------------------------------------------------

type common struct {
	endpoint     string
	conns        int
	timeout      time.Duration
	setupTimeout time.Duration
	rpcTimeout   time.Duration
	serverPid    string
	serverPids   []int
	producerEPs  string
	consumerEPs  string
	total        int
	valueSize    int
	label        string
	progress     time.Duration
	cpuProfile   string
}

func addCommon(fs *flag.FlagSet, c *common, total int) {
	fs.StringVar(&c.endpoint, "endpoint", "127.0.0.1:2379", "server address host:port")
	fs.IntVar(&c.conns, "conns", 4, "gRPC connections; streams and calls are spread over them")
	fs.DurationVar(&c.timeout, "timeout", 120*time.Second, "bound of the measured phase: the run fails if it is not done by then")
	fs.DurationVar(&c.setupTimeout, "setup-timeout", 60*time.Second, "bound of the setup (connect, watches, prefill)")
	fs.DurationVar(&c.rpcTimeout, "rpc-timeout", 30*time.Second, "deadline of each unary call")
	fs.StringVar(&c.serverPid, "server-pid", "", "pid of the server, or comma-separated pids (the members of a cluster): their CPU time (and their descendants') is read from /proc over the measured phase and summed")
	fs.StringVar(&c.producerEPs, "producer-endpoints", "", "comma-separated host:port the producers use, spread round robin (default: --endpoint)")
	fs.StringVar(&c.consumerEPs, "consumer-endpoints", "", "comma-separated host:port the consumers (watches and acks or claims) use, spread round robin (default: --endpoint)")
	fs.IntVar(&c.total, "total", total, "messages (items, notifications) in the run")
	fs.IntVar(&c.valueSize, "value-size", 256, "bytes per message value (at least 16: send time and number)")
	fs.StringVar(&c.label, "label", "", "free text copied into the JSON output")
	fs.DurationVar(&c.progress, "progress", 2*time.Second, "interval of progress lines on stderr (0: none)")
	fs.StringVar(&c.cpuProfile, "cpuprofile", "", "write this driver's CPU profile (pprof) of the whole run to this file")
}

func (c *common) validate() error {
	if c.conns < 1 {
		return errors.New("--conns must be at least 1")
	}
	if c.total < 1 {
		return errors.New("--total must be at least 1")
	}
	if c.valueSize < 16 {
		return errors.New("--value-size must be at least 16")
	}
	if c.timeout <= 0 || c.setupTimeout <= 0 || c.rpcTimeout <= 0 {
		return errors.New("timeouts must be positive")
	}
	for _, field := range splitList(c.serverPid) {
		pid, err := strconv.Atoi(field)
		if err != nil || pid <= 0 {
			return fmt.Errorf("--server-pid: %q is not a pid", field)
		}
		c.serverPids = append(c.serverPids, pid)
	}
	return nil
}

// splitList splits a comma-separated flag value, dropping empty fields.
func splitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

func parseFlags(fs *flag.FlagSet, args []string, c *common, check func() error) bool {
	if err := fs.Parse(args); err != nil {
		return false
	}
	if fs.NArg() != 0 {
		fmt.Fprintf(os.Stderr, "unexpected arguments: %v\n", fs.Args())
		return false
	}
	err := c.validate()
	if err == nil && check != nil {
		err = check()
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", fs.Name(), err)
		return false
	}
	stopProfile = startProfile(c.cpuProfile)
	return true
}

// stopProfile ends the CPU profile started by parseFlags (a no-op without --cpuprofile).
var stopProfile = func() {}

// --- connections ------------------------------------------------------------------------------

func dial(ctx context.Context, endpoint string, n int) ([]*grpc.ClientConn, error) {
	conns := make([]*grpc.ClientConn, 0, n)
	for i := 0; i < n; i++ {
		conn, err := grpc.DialContext(ctx, endpoint,
			grpc.WithInsecure(),
			grpc.WithBlock(),
			grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20), grpc.MaxCallSendMsgSize(64<<20)),
		)
		if err != nil {
			closeAll(conns)
			return nil, fmt.Errorf("dial %s: %w", endpoint, err)
		}
		conns = append(conns, conn)
	}
	return conns, nil
}

// dialRole dials the connections of one role (producers or consumers): at least n, spread round
// robin over the comma-separated endpoints of `list`. An empty list means the role shares
// `fallback` (the --endpoint connections); the caller closes only what this dialled (`own`).
func dialRole(ctx context.Context, list string, n int, fallback []*grpc.ClientConn) (conns []*grpc.ClientConn, own bool, err error) {
	eps := splitList(list)
	if len(eps) == 0 {
		return fallback, false, nil
	}
	if n < len(eps) {
		n = len(eps)
	}
	for i := 0; i < n; i++ {
		c, err := dial(ctx, eps[i%len(eps)], 1)
		if err != nil {
			closeAll(conns)
			return nil, false, err
		}
		conns = append(conns, c...)
	}
	return conns, true, nil
}

func closeAll(conns []*grpc.ClientConn) {
	for _, c := range conns {
		_ = c.Close()
	}
}

// --- CPU time ---------------------------------------------------------------------------------

// userHZ is the unit of the times in /proc/PID/stat (USER_HZ, 100 on Linux's user ABI).
const userHZ = 100.0

// statTimes returns ppid and utime+stime+cutime+cstime (ticks) of pid from /proc/PID/stat.
func statTimes(pid int) (ppid int, ticks int64, ok bool) {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, 0, false
	}
	s := string(raw)
	at := strings.LastIndexByte(s, ')')
	if at < 0 || at+2 > len(s) {
		return 0, 0, false
	}
	f := strings.Fields(s[at+2:])
	if len(f) < 15 {
		return 0, 0, false
	}
	// f[0] is field 3 (state): f[1] ppid, f[11..14] utime, stime, cutime, cstime (fields 14..17)
	ppid, _ = strconv.Atoi(f[1])
	for _, x := range f[11:15] {
		v, _ := strconv.ParseInt(x, 10, 64)
		ticks += v
	}
	return ppid, ticks, true
}

// processTreeCPU is the CPU seconds of pid and all its live descendants (reaped ones count
// through their parent's cutime/cstime).
func processTreeCPU(pid int) (float64, bool) {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return 0, false
	}
	children := map[int][]int{}
	ticks := map[int]int64{}
	for _, e := range entries {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if ppid, t, ok := statTimes(p); ok {
			children[ppid] = append(children[ppid], p)
			ticks[p] = t
		}
	}
	if _, ok := ticks[pid]; !ok {
		return 0, false
	}
	var total int64
	todo := []int{pid}
	for len(todo) > 0 && len(todo) < 100000 {
		p := todo[len(todo)-1]
		todo = todo[:len(todo)-1]
		total += ticks[p]
		todo = append(todo, children[p]...)
	}
	return float64(total) / userHZ, true
}

func selfCPU() float64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	tv := func(t syscall.Timeval) float64 { return float64(t.Sec) + float64(t.Usec)/1e6 }
	return tv(ru.Utime) + tv(ru.Stime)
}

// window measures the measured phase: wall time, the servers' CPU and this process's CPU.
type window struct {
	serverPids []int
	t0, t1     time.Time
	srv0, srv1 float64
	srvOK      bool
	cli0, cli1 float64
}

// serversCPU is the CPU seconds of every pid's process tree, summed; false if one is unreadable.
func serversCPU(pids []int) (float64, bool) {
	var total float64
	for _, pid := range pids {
		s, ok := processTreeCPU(pid)
		if !ok {
			return 0, false
		}
		total += s
	}
	return total, true
}

func (w *window) open(serverPids []int) {
	w.serverPids = serverPids
	if len(serverPids) > 0 {
		w.srv0, w.srvOK = serversCPU(serverPids)
	}
	w.cli0 = selfCPU()
	w.t0 = time.Now()
}

// close ends the window at `end` (the last completion); the CPU figures are read now.
func (w *window) close(end time.Time) {
	if end.Before(w.t0) {
		end = time.Now()
	}
	w.t1 = end
	w.cli1 = selfCPU()
	if w.srvOK {
		var ok bool
		w.srv1, ok = serversCPU(w.serverPids)
		w.srvOK = ok
	}
}

// --- output -----------------------------------------------------------------------------------

type output struct {
	Workload           string             `json:"workload"`
	Label              string             `json:"label,omitempty"`
	Endpoint           string             `json:"endpoint"`
	ProducerEndpoints  []string           `json:"producer_endpoints,omitempty"`
	ConsumerEndpoints  []string           `json:"consumer_endpoints,omitempty"`
	OK                 bool               `json:"ok"`
	Failures           []string           `json:"failures"`
	Params             map[string]any     `json:"params"`
	Unit               string             `json:"unit"`
	Count              int64              `json:"count"`
	Seconds            float64            `json:"seconds"`
	PerSecond          float64            `json:"per_second"`
	LatencyOf          string             `json:"latency_of,omitempty"`
	LatencyMs          map[string]float64 `json:"latency_ms,omitempty"`
	ServerPids         []int              `json:"server_pids,omitempty"`
	ServerCPUSeconds   *float64           `json:"server_cpu_s"`
	ServerCPUUsPerUnit *float64           `json:"server_cpu_us_per_unit"`
	ClientCPUSeconds   float64            `json:"client_cpu_s"`
	ClientCPUUsPerUnit float64            `json:"client_cpu_us_per_unit"`
	Counts             map[string]int64   `json:"counts"`
	Errors             []string           `json:"errors,omitempty"`
}

func newOutput(workload string, c *common, unit string) *output {
	return &output{
		Workload:          workload,
		Label:             c.label,
		Endpoint:          c.endpoint,
		ProducerEndpoints: splitList(c.producerEPs),
		ConsumerEndpoints: splitList(c.consumerEPs),
		Failures:          []string{},
		Params:            map[string]any{},
		Unit:              unit,
		Counts:            map[string]int64{},
		ServerPids:        c.serverPids,
	}
}

func (o *output) fail(format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	o.Failures = append(o.Failures, msg)
	logf("FAIL: %s", msg)
}

// finish fills the rate and CPU figures from the window and `count` completions.
func (o *output) finish(w *window, count int64) {
	o.Count = count
	o.Seconds = w.t1.Sub(w.t0).Seconds()
	if o.Seconds > 0 {
		o.PerSecond = float64(count) / o.Seconds
	}
	o.ClientCPUSeconds = w.cli1 - w.cli0
	if count > 0 {
		o.ClientCPUUsPerUnit = o.ClientCPUSeconds * 1e6 / float64(count)
	}
	if w.srvOK {
		s := w.srv1 - w.srv0
		o.ServerCPUSeconds = &s
		if count > 0 {
			per := s * 1e6 / float64(count)
			o.ServerCPUUsPerUnit = &per
		}
	} else if len(w.serverPids) > 0 {
		o.fail("could not read the CPU time of server pid(s) %v from /proc", w.serverPids)
	}
}

// emit prints the JSON object and returns the exit status.
func (o *output) emit(errs *errorLog) int {
	stopProfile()
	if errs != nil {
		n, sample := errs.snapshot()
		o.Counts["rpc_errors"] = n
		o.Errors = sample
		if n > 0 {
			o.fail("%d RPC error(s), first: %s", n, sample[0])
		}
	}
	o.OK = len(o.Failures) == 0
	enc := json.NewEncoder(os.Stdout)
	if err := enc.Encode(o); err != nil {
		logf("writing the JSON output: %v", err)
		return 1
	}
	if !o.OK {
		logf("%s FAILED: %s", o.Workload, strings.Join(o.Failures, "; "))
		return 1
	}
	return 0
}

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "[queue-bench %s] %s\n", time.Now().Format("15:04:05"), fmt.Sprintf(format, args...))
}

// errorLog counts errors and keeps the first few messages.
type errorLog struct {
	mu     sync.Mutex
	n      int64
	sample []string
}

func (e *errorLog) add(what string, err error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.n++
	if len(e.sample) < 10 {
		e.sample = append(e.sample, what+": "+err.Error())
	}
}

func (e *errorLog) count() int64 {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.n
}

func (e *errorLog) snapshot() (int64, []string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.n, append([]string(nil), e.sample...)
}

// progress prints `line()` every `every` until stop is closed.
func progress(every time.Duration, stop <-chan struct{}, line func() string) {
	if every <= 0 {
		return
	}
	go func() {
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
				logf("%s", line())
			}
		}
	}()
}

// --- latency ----------------------------------------------------------------------------------

// percentiles (nearest rank) of durations in ns, in ms; nil when there are none.
func percentiles(ns []int64) map[string]float64 {
	if len(ns) == 0 {
		return nil
	}
	s := append([]int64(nil), ns...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	at := func(q float64) float64 {
		rank := int(q*float64(len(s))+0.999999) - 1
		if rank < 0 {
			rank = 0
		}
		if rank >= len(s) {
			rank = len(s) - 1
		}
		return float64(s[rank]) / 1e6
	}
	var sum float64
	for _, v := range s {
		sum += float64(v)
	}
	return map[string]float64{
		"p50": at(0.50), "p90": at(0.90), "p99": at(0.99), "p99.9": at(0.999),
		"max": float64(s[len(s)-1]) / 1e6, "mean": sum / float64(len(s)) / 1e6,
	}
}

// --- message tracking -------------------------------------------------------------------------

// tracker counts, per message number, how often it was produced and received.
type tracker struct {
	n        int
	produced []uint32
	got      []int32
	latency  []int64 // ns from produce to first receipt, by number
	dups     atomic.Int64
	unknown  atomic.Int64
	received atomic.Int64
}

func newTracker(n int) *tracker {
	return &tracker{n: n, produced: make([]uint32, n), got: make([]int32, n), latency: make([]int64, n)}
}

func (t *tracker) markProduced(seq int) { atomic.StoreUint32(&t.produced[seq], 1) }

// receive records a receipt of message seq; true for its first.
func (t *tracker) receive(seq uint64, latencyNs int64) bool {
	if seq >= uint64(t.n) {
		t.unknown.Add(1)
		return false
	}
	if atomic.AddInt32(&t.got[seq], 1) == 1 {
		t.latency[seq] = latencyNs
		t.received.Add(1)
		return true
	}
	t.dups.Add(1)
	return false
}

// check fills the counts and failures of the delivery check. Call it once every receiver ended.
func (t *tracker) check(o *output, what string) {
	var produced, missing, notProduced int64
	lat := make([]int64, 0, t.n)
	for i := 0; i < t.n; i++ {
		p := atomic.LoadUint32(&t.produced[i]) == 1
		g := atomic.LoadInt32(&t.got[i])
		if p {
			produced++
		}
		switch {
		case p && g == 0:
			missing++
		case !p && g > 0:
			notProduced++
		}
		if g > 0 {
			lat = append(lat, t.latency[i])
		}
	}
	o.Counts["produced"] = produced
	o.Counts["received"] = t.received.Load()
	o.Counts["duplicates"] = t.dups.Load()
	o.Counts["missing"] = missing
	o.Counts["unknown"] = t.unknown.Load() + notProduced
	if produced != int64(t.n) {
		o.fail("only %d of %d messages were produced", produced, t.n)
	}
	if missing > 0 {
		o.fail("%d produced message(s) never %s", missing, what)
	}
	if d := t.dups.Load(); d > 0 {
		o.fail("%d message(s) %s more than once", d, what)
	}
	if u := t.unknown.Load() + notProduced; u > 0 {
		o.fail("%d %s message(s) that were never produced", u, what)
	}
	o.LatencyMs = percentiles(lat)
}

// value is the message body: 8 bytes send time (ns since start), 8 bytes number, padding.
func value(size int, stamp int64, seq int) []byte {
	v := make([]byte, size)
	putU64(v[0:8], uint64(stamp))
	putU64(v[8:16], uint64(seq))
	for i := 16; i < size; i++ {
		v[i] = 'm'
	}
	return v
}

func parseValue(v []byte) (stamp int64, seq uint64, ok bool) {
	if len(v) < 16 {
		return 0, 0, false
	}
	return int64(getU64(v[0:8])), getU64(v[8:16]), true
}

func putU64(b []byte, x uint64) {
	for i := 7; i >= 0; i-- {
		b[i] = byte(x)
		x >>= 8
	}
}

func getU64(b []byte) uint64 {
	var x uint64
	for i := 0; i < 8; i++ {
		x = x<<8 | uint64(b[i])
	}
	return x
}

// --- small etcd helpers -----------------------------------------------------------------------

// prefixEnd is the range_end that covers every key starting with prefix.
func prefixEnd(prefix []byte) []byte {
	end := append([]byte(nil), prefix...)
	for i := len(end) - 1; i >= 0; i-- {
		if end[i] < 0xff {
			end[i]++
			return end[:i+1]
		}
	}
	return []byte{0}
}

func countKeys(ctx context.Context, kv pb.KVClient, key, end []byte, timeout time.Duration) (int64, error) {
	cctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	resp, err := kv.Range(cctx, &pb.RangeRequest{Key: key, RangeEnd: end, CountOnly: true})
	if err != nil {
		return 0, err
	}
	return resp.Count, nil
}

// openWatch opens a Watch stream with one watch and waits for it to be created.
func openWatch(ctx context.Context, conn *grpc.ClientConn, create *pb.WatchCreateRequest, timeout time.Duration) (pb.Watch_WatchClient, error) {
	stream, err := pb.NewWatchClient(conn).Watch(ctx)
	if err != nil {
		return nil, err
	}
	if err := stream.Send(&pb.WatchRequest{RequestUnion: &pb.WatchRequest_CreateRequest{CreateRequest: create}}); err != nil {
		return nil, err
	}
	type answer struct {
		resp *pb.WatchResponse
		err  error
	}
	got := make(chan answer, 1)
	go func() {
		for {
			resp, err := stream.Recv()
			if err != nil || resp.Created || resp.Canceled {
				got <- answer{resp, err}
				return
			}
		}
	}()
	select {
	case a := <-got:
		if a.err != nil {
			return nil, a.err
		}
		if a.resp.Canceled {
			return nil, fmt.Errorf("watch canceled at creation: %s", a.resp.CancelReason)
		}
		return stream, nil
	case <-time.After(timeout):
		return nil, fmt.Errorf("watch on %q not created within %s", create.Key, timeout)
	}
}

// ended reports whether err is the end of a stream we closed ourselves.
func ended(ctx context.Context, err error) bool {
	return ctx.Err() != nil || errors.Is(err, io.EOF) || errors.Is(err, context.Canceled)
}

// waitGroupFor waits for wg, at most d; false when it timed out.
func waitGroupFor(wg *sync.WaitGroup, d time.Duration) bool {
	done := make(chan struct{})
	go func() {
		wg.Wait()
		close(done)
	}()
	select {
	case <-done:
		return true
	case <-time.After(d):
		return false
	}
}

// semaphore bounds messages produced and not yet completed. acquire takes n slots at once
// (one producer at a time, so partial acquisitions cannot deadlock each other).
type semaphore struct {
	slots chan struct{}
	mu    sync.Mutex
}

func newSemaphore(n int) *semaphore { return &semaphore{slots: make(chan struct{}, n)} }

func (s *semaphore) acquire(ctx context.Context, n int) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i := 0; i < n; i++ {
		select {
		case s.slots <- struct{}{}:
		case <-ctx.Done():
			return false
		}
	}
	return true
}

func (s *semaphore) release(n int) {
	for i := 0; i < n; i++ {
		select {
		case <-s.slots:
		default:
			return // more completions than slots taken: counted as an error elsewhere
		}
	}
}
