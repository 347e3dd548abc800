// Command h2spec-run runs every h2spec conformance case (generic, http2, hpack)
// against one server and writes a JUnit report. It is our own small driver over
// the h2spec library in ../shared/tools/h2spec/upstream, whose own command is
// not in that folder. Built by scripts/build_h2spec.sh.
package main

import (
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/summerwind/h2spec"
	"github.com/summerwind/h2spec/config"
)

func main() {
	host := flag.String("h", "127.0.0.1", "server host")
	port := flag.Int("p", 2379, "server port")
	timeout := flag.Int("o", 2, "seconds to wait for each answer")
	junit := flag.String("j", "", "write a JUnit report here")
	flag.Parse()
	c := &config.Config{
		Host:         *host,
		Port:         *port,
		Path:         "/",
		Timeout:      time.Duration(*timeout) * time.Second,
		MaxHeaderLen: 4000,
		JUnitReport:  *junit,
	}
	ok, err := h2spec.Run(c)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	if !ok {
		os.Exit(1)
	}
}
