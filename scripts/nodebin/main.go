// dsnap-multicall: the Kubernetes control plane and node components, etcd, containerd and the GPU device
// plugin linked into one program. Each component runs as it would from its own binary: the name it is
// started under (a symlink: kube-apiserver, kubelet, containerd, ...) picks it, or the first argument
// (`dsnap-multicall kubelet --version`). One program shares its dependencies' code once: 175 MB where the
// separate binaries are 460 MB, small enough to carry to a machine that has none of them.
//
// Each entry below is the component's own main function, as its upstream source has it.
package main

import (
	"context"
	goflag "flag"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	_ "time/tzdata" // kube-apiserver and kube-controller-manager link it for CronJob time zones

	shimmanager "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2/manager"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2/task/plugin"
	_ "github.com/containerd/containerd/v2/cmd/containerd/builtins"
	containerd "github.com/containerd/containerd/v2/cmd/containerd/command"
	ctr "github.com/containerd/containerd/v2/cmd/ctr/app"
	"github.com/containerd/containerd/v2/pkg/shim"
	"go.etcd.io/etcd/server/v3/etcdmain"
	_ "k8s.io/client-go/plugin/pkg/client/auth"
	"k8s.io/component-base/cli"
	"k8s.io/component-base/logs"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	kubectl "k8s.io/kubectl/pkg/cmd"
	kubectlutil "k8s.io/kubectl/pkg/cmd/util"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	proxy "k8s.io/kubernetes/cmd/kube-proxy/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"
)

// commandEnv names the component for a process started under the program's own name: the runc shim starts
// its long-running copy from os.Executable(), which is this file's path, not the symlink it was run as.
const commandEnv = "DSNAP_MULTICALL_COMMAND"

var commands = map[string]func(){
	"kube-apiserver": func() { os.Exit(cli.Run(apiserver.NewAPIServerCommand())) },
	"kube-controller-manager": func() {
		os.Exit(cli.Run(controllermanager.NewControllerManagerCommand()))
	},
	"kube-scheduler": func() { os.Exit(cli.Run(scheduler.NewSchedulerCommand())) },
	"kubelet":        func() { os.Exit(cli.Run(kubelet.NewKubeletCommand(context.Background()))) },
	"kube-proxy": func() {
		// kube-proxy takes every flag of Go's global flag set; alone it links none, here the kubelet's
		// cAdvisor registers its own there.
		goflag.CommandLine = goflag.NewFlagSet(os.Args[0], goflag.ExitOnError)
		os.Exit(cli.Run(proxy.NewProxyCommand()))
	},
	"kubectl": func() {
		logs.GlogSetter(kubectl.GetLogVerbosity(os.Args)) // nolint:errcheck
		if err := cli.RunNoErrOutput(kubectl.NewDefaultKubectlCommand()); err != nil {
			kubectlutil.CheckErr(err)
		}
	},
	"etcd": func() { etcdmain.Main(os.Args) },
	"containerd": func() {
		daemonPlugins()
		if err := containerd.App().Run(os.Args); err != nil {
			fmt.Fprintf(os.Stderr, "containerd: %s\n", err)
			os.Exit(1)
		}
	},
	"containerd-shim-runc-v2": func() {
		os.Setenv(commandEnv, "containerd-shim-runc-v2")
		runcShimPlugins()
		shim.Run(context.Background(), shimmanager.NewShimManager("io.containerd.runc.v2"))
	},
	"ctr": func() {
		if err := ctr.New().Run(os.Args); err != nil {
			fmt.Fprintf(os.Stderr, "ctr: %s\n", err)
			os.Exit(1)
		}
	},
	"gpu-device-plugin": func() { os.Exit(runDevicePlugin(os.Args)) },
}

func main() {
	name := filepath.Base(os.Args[0])
	if _, ok := commands[name]; !ok {
		switch {
		case os.Getenv(commandEnv) != "":
			name = os.Getenv(commandEnv)
		case len(os.Args) > 1:
			name = os.Args[1]
			os.Args = os.Args[1:]
		}
	}
	run, ok := commands[name]
	if !ok {
		names := make([]string, 0, len(commands))
		for n := range commands {
			names = append(names, n)
		}
		sort.Strings(names)
		fmt.Fprintf(os.Stderr, "%s: unknown command %q; run it as one of (a link named so, or the first argument): %v\n",
			filepath.Base(os.Args[0]), name, names)
		os.Exit(2)
	}
	run()
}
